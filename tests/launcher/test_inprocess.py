"""``tierckpt run`` with workers under ``tierckpt.resilient``: 2 agents x 1 worker, gloo on 127.0.0.1.

A hang (rank 1 blocks forever; rank 0 in its all-reduce) is detected by the launcher, which
asks for an in-process restart; a NaN is raised in the worker, which restarts in-process by
itself and reports it. Either way the processes stay (same pid), the state rolls back bit for
bit, the job finishes, and every agent's events carry a ``restart`` of ``kind="inprocess"``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.launcher.cluster import LocalJob

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("fault", "reason"), [("hang", "Hang"), ("nan", "NonFiniteLoss")])
def test_fault_restarts_in_process_under_the_launcher(make_job: Callable[..., LocalJob], fault: str,
                                                      reason: str) -> None:
    job = make_job(train=["--steps", "24", "--inprocess", "--fault", fault, "--fault-step", "8"])
    job.start()
    assert job.wait_exit(200) == {0: 0, 1: 0}, job.report()
    for node in (0, 1):
        ev = job.events(node)
        restarts = [e for e in ev if e["event"] == "restart"]
        assert [e["kind"] for e in restarts] == ["inprocess"], job.report()
        faults = [e for e in ev if e["event"] == "fault"]
        assert faults and reason in str(faults[0]["reason"]) and faults[0]["node"] == 1, job.report()
        assert not any(e["event"] == "stopped" for e in ev), "no process may be stopped"
    for rank in (0, 1):
        tr = job.trace(rank)
        assert len({e["pid"] for e in tr}) == 1, "the worker process must survive"
        back = [e for e in tr if e["event"] == "resumed" and e.get("inproc") == 1]
        assert back and back[0]["step"] is not None, job.report()
        saved = {e["step"]: e["digest"] for e in tr if e["event"] == "step" and e.get("inproc") == 0}
        assert saved[back[0]["step"]] == back[0]["digest"], "rollback must be bitwise"
        assert tr[-1]["event"] == "done"
