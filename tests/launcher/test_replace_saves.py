"""Saves go on after a rank is replaced alone: ``tierckpt run``, 2 ranks on one node, a compiled model, one global
checkpoint saved every step, the training under ``tierckpt.resilient`` (issue 24, item 1).

Rank 1 is SIGKILLed; its replacement joins the survivor's next in-process generation. Every save
after that must commit (the newest committed step is the last one) with no further restart of
any kind: before the fix each later save failed with ``KeyError: 'DefaultSavePlanner'`` (DCP's
plan cache, kept by the survivor and absent in the replacement), and each failure became
another in-process restart until they were used up.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.launcher.cluster import NS, LocalJob

pytestmark = pytest.mark.slow

STEPS = 30
KILL_AT = 10


def _committed(memory_root: str) -> list[int]:
    root = Path(memory_root) / NS
    return sorted(int(d.name[5:]) for d in root.glob("step_*") if (d / "COMMITTED").exists())


@pytest.mark.timeout(420)
def test_saves_commit_after_a_rank_is_replaced_alone(make_job: Callable[..., LocalJob]) -> None:
    job = make_job(nnodes=1, run_args=["--nproc-per-node=2"],
                   train=["--steps", str(STEPS), "--step-time", "0.1", "--inprocess", "--global-mode", "--compile"])
    job.start()
    job.wait_for(lambda: min(job.last_step(0), job.last_step(1)) >= KILL_AT, 150, f"both ranks reach step {KILL_AT}")
    survivor, victim = job.worker_pid(0), job.worker_pid(1)
    os.kill(victim, signal.SIGKILL)
    assert job.wait_exit(240) == {0: 0}, job.report()
    restarts = [e for e in job.events(0) if e["event"] == "restart"]
    assert [(e["kind"], e["reason"]) for e in restarts] == [("replace", "Crash")], job.report()
    assert not any(e["event"] == "stopped" for e in job.events(0)), "no process may be stopped"
    assert {e["pid"] for e in job.trace(0)} == {survivor}, "the survivor keeps its process"
    pids = {e["pid"] for e in job.trace(1)}
    assert victim in pids and len(pids) == 2, pids
    resumed = [e for e in job.trace(0) if e["event"] == "resumed" and e.get("inproc", 0) >= 1]
    assert len(resumed) == 1 and resumed[0]["step"] is not None, job.report()
    assert _committed(job.memory[0])[-1] == STEPS, (_committed(job.memory[0]), job.report())
    for rank in (0, 1):
        assert job.trace(rank)[-1]["event"] == "done"
