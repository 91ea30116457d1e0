"""Faults far apart, each after healthy progress, restart at once under ``tierckpt run`` (issue 24,
item 2): no ``backoff`` event, however many faults; a crash loop still backs off
(``test_scenarios.py::test_crash_on_start_backs_off_then_crash_loop``)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest

from tests.launcher.cluster import LocalJob

pytestmark = pytest.mark.slow

KILLS, APART = 4, 14  # each fault 14 steps after the last: past the default healthy_after_steps (10)


def test_faults_after_healthy_progress_do_not_back_off(make_job: Callable[..., LocalJob]) -> None:
    job = make_job(train=["--steps", str(APART * (KILLS + 1))], max_restarts=KILLS + 1)
    job.start()
    resumed_at = 0
    for k in range(KILLS):
        at, rank = resumed_at + APART, k % 2
        job.wait_for(lambda at=at, k=k, rank=rank: job.last_step(rank, generation=k) >= at, 120,
                     f"rank {rank} reaches step {at} in generation {k}")
        os.kill(job.worker_pid(rank), signal.SIGKILL)
        got = job.wait_for(lambda k=k: job.resumed(0, k + 1), 120, f"rank 0 resumes in generation {k + 1}")
        resumed_at = int(got["step"] or 0)
    assert job.wait_exit(150) == {0: 0, 1: 0}, job.report()
    for node in (0, 1):
        ev = job.events(node)
        assert len([e for e in ev if e["event"] == "restart"]) == KILLS, job.report()
        assert [e for e in ev if e["event"] == "backoff"] == [], job.report()
