"""Warm restarts under ``tierckpt run``: a SIGKILLed worker's generation is served by standby
interpreters started before the fault, resumes the newest committed step bit for bit, and the
standbys are replaced for the next fault; ``--no-warm`` starts cold.

Real processes: 2 agents x 1 worker, gloo on 127.0.0.1, real SIGKILL.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.launcher.cluster import LocalJob
from tests.launcher.test_scenarios import RANKS, assert_recovered

pytestmark = pytest.mark.slow


def _starts(job: LocalJob, rank: int, generation: int) -> list[dict[str, Any]]:
    return [e for e in job.trace(rank) if e["event"] == "start" and e["generation"] == generation]


def _standbys_ready(job: LocalJob) -> bool:
    """Every agent has a standby that finished its imports after its latest (re)start."""
    for node in range(job.nnodes):
        ev = job.events(node)
        last = max(e["time"] for e in ev if e["event"] in ("started", "restart"))
        if not any(e["event"] == "standby" and "ready" in e and e["time"] > last for e in ev):
            return False
    return True


def _kill_and_recover(job: LocalJob, generation: int, *, warm: bool = True) -> float:
    """SIGKILL rank 1's worker in ``generation`` once it passed a step and the standbys are
    ready (the steady state: faults are rarer than imports); the kill's wall time."""
    if warm:
        job.wait_for(lambda: _standbys_ready(job), 90, "a ready standby on every agent")
    base = job.last_step(1)
    job.wait_for(lambda: job.last_step(1, generation=generation) >= base + 3, 90,
                 f"rank 1 steps in generation {generation}")
    t_kill = time.time()
    os.kill(job.worker_pid(1), signal.SIGKILL)
    job.wait_for(lambda: all(job.resumed(r, generation + 1) for r in RANKS), 90,
                 f"both ranks resume in generation {generation + 1}")
    return t_kill


def test_restarts_are_served_by_standbys_started_before_the_fault(make_job: Callable[..., LocalJob]) -> None:
    job = make_job(train=["--steps", "250"])
    job.start()
    job.wait_for(lambda: job.last_step(1) >= 5, 90, "rank 1 reaches step 5")
    kills = []
    for gen in (0, 1):  # two faults in a row: the consumed standbys were replaced in between
        kills.append(_kill_and_recover(job, gen))
    assert job.wait_exit(120) == {0: 0, 1: 0}, job.report()
    for gen, t_kill in zip((0, 1), kills, strict=True):
        assert_recovered(job, gen, "Crash", node=1, rank=1)
        for r in RANKS:
            start = _starts(job, r, gen + 1)
            assert len(start) == 1 and start[0]["warm"] is True, (r, start)
            # the interpreter that ran generation gen+1 was started (torch imported) before the kill
            assert start[0]["warm_since"] < t_kill, (r, start[0], t_kill)
            old_pids = {e["pid"] for e in job.trace(r) if e["generation"] <= gen}
            assert start[0]["pid"] not in old_pids
        for node in range(2):
            restart = [e for e in job.events(node) if e["event"] == "restart" and e["generation"] == gen + 1]
            assert restart and restart[0]["warm"] == [0], restart
    for r in RANKS:
        assert job.last_step(r, generation=2) == 250


def test_no_warm_starts_cold(make_job: Callable[..., LocalJob]) -> None:
    job = make_job(train=["--steps", "30"], run_args=["--no-warm"])
    job.start()
    job.wait_for(lambda: job.last_step(1) >= 5, 90, "rank 1 reaches step 5")
    _kill_and_recover(job, 0, warm=False)
    assert job.wait_exit(120) == {0: 0, 1: 0}, job.report()
    assert_recovered(job, 0, "Crash", node=1, rank=1)
    for r in RANKS:
        assert [e["warm"] for e in job.trace(r) if e["event"] == "start"] == [False, False]
    assert not [e for e in job.events() if e["event"] == "standby"]
    assert all(e["warm"] == [] for e in job.events() if e["event"] in ("started", "restart"))


def _first_step_time(job: LocalJob, generation: int) -> float | None:
    """When both ranks finished their first step of ``generation`` (None: not yet)."""
    times = []
    for r in RANKS:
        steps = [e["time"] for e in job.trace(r) if e["event"] == "step" and e["generation"] == generation]
        if not steps:
            return None
        times.append(min(steps))
    return max(times)


def test_a_second_fault_right_after_a_restart_is_warm(make_job: Callable[..., LocalJob]) -> None:
    """Two SIGKILLs ~1 s apart: the replacements of the first restart are still importing, so
    the second restart is served by the spares (ready before the first kill)."""
    job = make_job(train=["--steps", "250"])
    job.start()
    job.wait_for(lambda: all(len([e for e in job.events(n) if e["event"] == "standby" and "ready" in e]) >= 2
                             for n in range(2)), 120, "every agent has its standbys and spares ready")
    job.wait_for(lambda: job.last_step(1) >= 5, 90, "rank 1 reaches step 5")
    t_kill1 = time.time()
    os.kill(job.worker_pid(1), signal.SIGKILL)
    job.wait_for(lambda: _first_step_time(job, 1), 60, "both ranks step in generation 1")
    time.sleep(max(0.0, t_kill1 + 1.0 - time.time()))  # the second fault: ~1 s after the first
    t_kill2 = time.time()
    os.kill(job.worker_pid(1), signal.SIGKILL)
    first = job.wait_for(lambda: _first_step_time(job, 2), 60, "both ranks step in generation 2")
    assert job.wait_exit(150) == {0: 0, 1: 0}, job.report()
    for r in RANKS:
        start = _starts(job, r, 2)
        assert len(start) == 1 and start[0]["warm"] is True, (r, start)
        assert start[0]["warm_since"] < t_kill1, (r, start[0], t_kill1)  # a spare, ready before the faults
    print(f"second fault, {t_kill2 - t_kill1:.2f}s after the first: both ranks step again "
          f"{first - t_kill2:.2f}s after the kill")
    assert first - t_kill2 < 3.0  # warm: 1.49 s at load average 8.8 on 2 cores; a cold start is ~3 s idle
