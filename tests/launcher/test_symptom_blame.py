"""A worker that died of its peer's crash is not the culprit, whichever agent sees its crash first.

CI's slow tier failed under load: rank 1 crashed (``exit 3``), rank 0's all-reduce failed a moment
later ("Connection reset by peer") and node 0's agent claimed *its* rank's exit before node 1's agent
claimed the real crash; the fault, the restart and the offender policy then blamed node 0. Here the
race is forced: node 1's agent is stopped (SIGSTOP to the agent alone, not its worker) around the
crash and continued once rank 0 has died of it, well inside ``--node-timeout`` (the user's default,
10 s). Node 0's agent sees a crash whose output shows a peer's failure, holds it (symptom.py), and
follows node 1's claim. 2 agents x 1 worker, gloo on 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

from tests.launcher.cluster import LocalJob, alive
from tests.launcher.test_scenarios import RANKS, assert_recovered
from tierckpt.launcher.decide.diagnose import CRASH_SUSPECT_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_peer_that_crashed_is_blamed_though_the_survivor_saw_a_crash_first(
        make_job: Callable[..., LocalJob]) -> None:
    job = make_job(train=["--steps", "30", "--step-time", "0.1", "--fault", "exit", "--fault-step", "12"],
                   node_timeout=10.0)
    job.start()
    job.wait_for(lambda: job.last_step(1) >= 9, 120, "rank 1 reaches step 9")
    rank0 = job.worker_pid(0)
    agent1 = job.agents[1].pid
    t_stop = time.monotonic()
    os.kill(agent1, signal.SIGSTOP)
    try:
        job.wait_for(lambda: not alive(rank0), 30, "rank 0 dies of rank 1's crash")
        time.sleep(0.5)  # node 0's agent has seen its worker's exit long before node 1's agent runs again
    finally:
        os.kill(agent1, signal.SIGCONT)
    stopped_s = time.monotonic() - t_stop
    assert job.wait_exit(150) == {0: 0, 1: 0}, job.report()
    # node 1 is blamed either way: its agent claims its worker's crash once it runs again, or, when it
    # stayed silent as long as a lost machine's (CRASH_SUSPECT_S: under load rank 0 takes that long
    # to die), the survivor's diagnosis names node 1 lost; never the survivor's own symptom
    if stopped_s < CRASH_SUSPECT_S - 0.3:
        assert_recovered(job, 0, "Crash", node=1, rank=1)
    for node in range(2):
        (fault,) = [e for e in job.events(node) if e["event"] == "fault"]
        assert "symptom" not in fault, fault  # the cause's own claim, not a symptom's
        assert fault["node"] == 1, (stopped_s, job.report())
        (restart,) = [e for e in job.events(node) if e["event"] == "restart"]
        if stopped_s < CRASH_SUSPECT_S - 0.3:
            assert (fault["rank"], fault["detail"]) == (1, "exit code 3"), job.report()
            assert restart["reason"] == "Crash", restart
        elif fault["reason"] == "LostNode":
            assert fault["diagnosis"]["cause"] == "lost_node", fault
    assert all(job.last_step(r) == 30 for r in RANKS)
