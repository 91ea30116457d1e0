"""True stalls are still caught, each blamed on the right rank and node (issue 25): a deadlock of
mismatched communication names the rank that waits where the others do not, and a rank spinning
in Python with its peers waiting for it is named at the configured ceiling, not its peers.

Real ``tierckpt run`` agents (``LocalJob``, the user's defaults but where a test says otherwise)
with gloo on 127.0.0.1, one worker per agent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.launcher.cluster import LocalJob
from tests.launcher.test_scenarios import saved_digests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _faults(job: LocalJob, node: int) -> list[dict[str, Any]]:
    return [e for e in job.events(node) if e["event"] == "fault"]


def _injected(job: LocalJob, rank: int) -> dict[str, Any]:
    return next(e for e in job.trace(rank) if e["event"] == "fault")


def _assert_resumed_bitwise(job: LocalJob, ranks: range) -> None:
    """Generation 1 resumed every rank at one step, bit for bit the state saved at that step."""
    resumed = {r: job.resumed(r, 1) for r in ranks}
    assert all(v is not None and v["step"] is not None for v in resumed.values()), (resumed, job.report())
    steps = {v["step"] for v in resumed.values() if v is not None}
    assert len(steps) == 1, resumed
    (step,) = steps
    for r in ranks:
        got = resumed[r]
        assert got is not None and got["digest"] == saved_digests(job, r, 1)[step], f"rank {r} resumed other state"


def test_mismatched_communication_names_the_rank_that_waits_where_the_others_do_not(
        make_job: Callable[..., LocalJob]) -> None:
    """3 nodes: at step 10 rank 1 receives from rank 2, which never sends; ranks 0 and 2 wait in
    their next all-reduce. Every rank then waits in torch without CPU (a deadlock): the wait sites
    name rank 1 (the odd one of three), whose node claims ``Hang`` within 6 s of the deadlock;
    the others hold their own stall as a symptom and follow."""
    job = make_job(nnodes=3, train=["--steps", "30", "--fault", "mismatch", "--fault-step", "10"])
    job.start()
    assert job.wait_exit(240) == {0: 0, 1: 0, 2: 0}, job.report()
    t_deadlock = _injected(job, 1)["time"]
    for node in range(3):
        fault = _faults(job, node)[0]
        assert (fault["reason"], fault["node"], fault["rank"]) == ("Hang", 1, 1), job.report()
        assert fault["generation"] == 0 and "symptom" not in fault, fault
    fault = _faults(job, 1)[0]
    assert fault["time"] - t_deadlock <= 6.0, (fault["time"] - t_deadlock, fault)
    assert "do not" in fault["detail"] and fault["diagnosis"]["cause"] == "stall", fault
    assert [e["evidence"].get("odd_one") for e in fault["diagnosis"]["evidence"] if e["kind"] == "stall"] == [True]
    _assert_resumed_bitwise(job, range(3))
    assert all(job.last_step(r) == 30 for r in range(3))


def test_a_rank_spinning_in_python_is_named_at_the_ceiling_not_its_waiting_peer(
        make_job: Callable[..., LocalJob]) -> None:
    """At step 10 rank 1 loops in Python forever (busy, no heartbeat); rank 0 waits in its
    all-reduce. A busy rank may be a long evaluation: it is a hang at ``--hang-ceiling`` (12 s
    here), and rank 0's silence, as long, is its symptom: node 1 and rank 1 are named on both nodes."""
    ceiling = 12.0
    job = make_job(train=["--steps", "30", "--fault", "spin", "--fault-step", "10"],
                   run_args=[f"--hang-ceiling={ceiling:g}"])
    job.start()
    assert job.wait_exit(240) == {0: 0, 1: 0}, job.report()
    t_spin = _injected(job, 1)["time"]
    for node in range(2):
        fault = _faults(job, node)[0]
        assert (fault["reason"], fault["node"], fault["rank"]) == ("Hang", 1, 1), job.report()
        assert "busy" in fault["detail"] and "symptom" not in fault, fault
    elapsed = _faults(job, 1)[0]["time"] - t_spin
    assert ceiling - 0.5 <= elapsed <= ceiling + 3.0, elapsed
    _assert_resumed_bitwise(job, range(2))
    assert all(job.last_step(r) == 30 for r in range(2))
