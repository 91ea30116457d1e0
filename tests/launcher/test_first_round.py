"""A hot spare started together with the job (a Kubernetes spare pod, a Slurm allocation that starts
every node at once) under ``tierckpt run`` on real processes: three agents for ``--nnodes 2:2``
launched in the same moment, in different orders, on 127.0.0.1 (each its own memory root, 1
worker each, gloo).

Exactly one of them must stand by as a spare and disturb nothing, not even when a live node's
agent is frozen for longer than torch's keep-alive expiry (3 s): a spare in torch's redundancy
list drops that participant at its next sync, moves to the wait list, and the job restarts for
a ``MembershipChange`` in which the spare may take the frozen node's rank (docs/launcher.md
"Hot spares"). The freeze (SIGSTOP of the agent alone; its worker trains on) stands for the late
keep-alive beat of a loaded machine, deterministically.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

from tests.launcher.cluster import LocalJob

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RANKS = (0, 1)
STEPS = 220  # 0.2 s each: the job outlasts three agents' start-up on a loaded machine and the freeze
FREEZE_S = 8.0  # > torch's keep-alive expiry under tierckpt run (1 s x 3), < --node-timeout


def _standing_by(job: LocalJob) -> list[int]:
    return [n for n in range(job.slots) if any(e["event"] == "spare" and e["state"] == "standby"
                                               for e in job.events(n))]


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0]], ids=["host-first", "host-last"])
def test_a_spare_started_with_the_job_stands_by_at_the_gate(make_job: Callable[..., LocalJob],
                                                           order: list[int]) -> None:
    job = make_job(train=["--steps", str(STEPS), "--step-time", "0.2"], node_timeout=20.0, slots=3,
                   nnodes_arg="2:2")
    job.start(order=order)  # all three at once: none of them knows yet whether the job is full
    spares = job.wait_for(lambda: _standing_by(job), 150, "one agent stands by as a spare")
    live = [n for n in range(job.slots) if n not in spares]
    job.wait_for(lambda: all(any(e["event"] == "started" for e in job.events(n)) for n in live), 150,
                 "the other two form the job")
    assert len(spares) == 1 and len(live) == 2, job.report()
    spare = spares[0]
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= 5, 90, "both ranks reach step 5")
    ranks_before = {n: job.group_rank(n) for n in live}
    assert sorted(ranks_before.values()) == [0, 1], ranks_before
    # freeze a live agent that does not host the store (node 0's agent does: freezing it freezes the store)
    frozen = max(n for n in live if n != 0)
    os.kill(job.agents[frozen].pid, signal.SIGSTOP)
    try:
        time.sleep(FREEZE_S)  # the fault's duration, not a check
    finally:
        os.kill(job.agents[frozen].pid, signal.SIGCONT)
    step_then = min(job.last_step(r) for r in RANKS)
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= step_then + 10, 90, "10 more steps after the freeze")
    codes = job.wait_exit(300)
    assert codes == {0: 0, 1: 0, 2: 0}, job.report()
    # nothing happened: no fault, no restart, one generation; the spare never took a rank
    assert not [e for e in job.events() if e["event"] in ("fault", "restart", "membership")], job.report()
    assert {e["generation"] for r in RANKS for e in job.trace(r)} == {0}
    assert not [e for e in job.events(spare) if e["event"] in ("started", "stopped")
                or (e["event"] == "spare" and e["state"] == "joined")], job.report()
    assert {n: job.group_rank(n) for n in live} == ranks_before
    exit_ev = [e for e in job.events(spare) if e["event"] == "exit"]
    assert exit_ev and exit_ev[-1]["code"] == 0 and "spare" in exit_ev[-1].get("why", ""), exit_ev
    assert all(job.last_step(r) == STEPS for r in RANKS)
    print(f"first-round spare: node {spare} stood by (start order {order}); node {frozen}'s agent frozen "
          f"{FREEZE_S:g}s without a restart")
