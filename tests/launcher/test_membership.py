"""Hot spares and elastic membership under ``tierckpt run`` on real processes (agents on 127.0.0.1,
each its own memory root, 1 worker each, gloo; a lost node is a SIGKILL of its whole agent).

- a hot spare (a third agent for ``--nnodes 2``) waits in the rendezvous without disturbing the
  job; when a node is lost it takes the lost node's rank in the next round (no full job restart)
  and resumes that rank from the peer replica, bit for bit on the fault-free trajectory;
- elastic jobs (``--nnodes MIN:MAX``): a node arriving below MAX scales the job up without
  spending a restart; a lost node with survivors >= MIN and no spare shrinks the job through the
  survivors' regroup, without a torch rendezvous round.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.launcher.cluster import LocalJob, newest_replica, replica_steps
from tests.launcher.test_node_loss import assert_resumed_on_trajectory, reference_digests, steps_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # a module fixture runs a fault-free reference first; three agents on 2 cores

RANKS = (0, 1)
STEPS = 200


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, dict[int, str]]]:
    """rank -> step -> parameter digest of the same training without a fault (the reference)."""
    yield from reference_digests(tmp_path_factory, STEPS, timeout=240)


def _first_step_after(job: LocalJob, rank: int, generation: int) -> float | None:
    times = [e["time"] for e in job.trace(rank) if e["event"] == "step" and e["generation"] >= generation]
    return min(times) if times else None


@pytest.mark.parametrize("rdzv", ["c10d", "tierckpt"])
def test_hot_spare_takes_the_lost_nodes_rank(make_job: Callable[..., LocalJob],
                                             fault_free: dict[int, dict[int, str]], rdzv: str) -> None:
    """A third agent on ``--nnodes 2:2`` stands by; node 1's machine is lost; the spare takes rank 1
    in the next round without a full job restart and resumes it from node 0's replica."""
    # 0.3 s steps (the same trajectory as the reference's 0.1 s: only the pace differs) so that the
    # job outlasts the spare's start-up and warm-up on a loaded machine
    job = make_job(train=["--steps", str(STEPS), "--step-time", "0.3"], run_args=["--replicas", "1"],
                   slots=3, nnodes_arg="2:2")
    job.rdzv_backend = rdzv  # torch's c10d handler, or ours (membership/rdzv.py)
    job.start(order=[0, 1])
    job.wait_for(lambda: all(any(e["event"] == "started" for e in job.events(n)) for n in (0, 1)), 120,
                 "nodes 0 and 1 form the job")
    job.start_agent(2)  # the round is complete: the third agent can only stand by
    spare = job.wait_for(lambda: next((e for e in job.events(2) if e["event"] == "spare"), None), 120,
                         "the third agent stands by as a spare")
    assert spare["state"] == "standby" and spare["job_nodes"] == 2, spare
    job.wait_for(lambda: any(e["event"] == "spare" and e["state"] == "warm" for e in job.events(2)), 120,
                 "the spare's standbys finished their imports")
    # the spare disturbs nothing: no fault, no restart, the generation stays 0 while it waits
    step_then = min(job.last_step(r) for r in RANKS)
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= step_then + 15, 60, "15 more steps with a spare")
    assert not [e for e in job.events() if e["event"] in ("fault", "restart")], job.report()
    assert {e["generation"] for r in RANKS for e in job.trace(r)} == {0}
    job.wait_for(lambda: replica_steps(job.memory[0]), 30, "node 0 holds a replica")
    at_kill = min(job.last_step(r) for r in RANKS)
    t_kill = time.time()
    job.kill_machine(1)
    joined = job.wait_for(lambda: next((e for e in job.events(2) if e["event"] == "spare"
                                        and e["state"] == "joined"), None), 90, "the spare joins")
    assert joined["node"] == 1 and joined["replaced"] == f"{_host()}:{job.memory[1]}", joined
    assert joined["standby_s"] > 0, joined
    gen = int(joined["generation"])
    for r in RANKS:
        job.wait_for(lambda r=r: _first_step_after(job, r, gen), 60, f"rank {r} trains in generation {gen}")
    back = max(_first_step_after(job, r, gen) or 0.0 for r in RANKS) - t_kill
    print(f"hot spare: SIGKILL of node 1 -> both ranks training again: {back:.2f}s")
    codes = job.wait_exit(240, nodes=[0, 2])
    assert codes == {0: 0, 2: 0}, job.report()
    assert not [e for e in job.events() if e["event"] == "restart" and e.get("kind") == "job"], job.report()
    assert job.group_rank(2) == 1 and job.group_rank(0) == 0
    started = [e for e in job.events(2) if e["event"] == "started"]
    assert started and started[-1]["warm"] == [0], started  # its standby was warm before the fault
    changes = [e for e in job.events(0) if e["event"] == "membership"]
    assert changes and changes[-1]["replaced"] == [{"node": 1, "left": f"{_host()}:{job.memory[1]}",
                                                    "by": f"{_host()}:{job.memory[2]}"}], changes
    assert_resumed_on_trajectory(job, gen, fault_free, at_least=max(1, at_kill - 1), steps=STEPS)
    assert "peer" in (job.resumed(1, gen) or {}).get("tiers", []), job.resumed(1, gen)


def _host() -> str:
    import socket

    return socket.gethostname()


def _state(job: LocalJob, node: int) -> dict[str, Any]:
    return dict(json.loads((Path(job.memory[node]) / ".tierckpt-run" / f"{job.rdzv_id}.json").read_text()))


@pytest.mark.parametrize("rdzv", ["c10d", "tierckpt"])
def test_elastic_job_shrinks_by_regroup_and_grows_without_spending_a_restart(
        make_job: Callable[..., LocalJob], rdzv: str) -> None:
    """``--nnodes 1:2``: node 1's machine is lost, node 0 goes on alone through the survivors'
    regroup (no rendezvous round); node 1 comes back, the job grows to 2 nodes at the next poll,
    and that arrival costs no restart (the state file's ``restarts`` stays 1, the lost node's)."""
    steps = 500  # long enough for node 1's agent to start again on a loaded machine while rank 0 trains alone
    job = make_job(train=["--steps", str(steps), "--global-mode"], nnodes_arg="1:2")
    job.rdzv_backend = rdzv
    job.start()
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= 8, 120, "both ranks reach step 8")
    job.wait_for(lambda: replica_steps(job.memory[0]), 30, "node 0 holds a replica")
    at_kill = job.last_step(0)
    t_kill = time.time()
    job.kill_machine(1)
    shrunk = job.wait_for(lambda: next((e for e in job.events(0) if e["event"] == "membership"), None), 60,
                          "node 0 regroups alone")
    assert shrunk["via"] == "regroup" and shrunk["nnodes"] == 1 and shrunk["left"] == [f"{_host()}:{job.memory[1]}"]
    g1 = int(shrunk["generation"])
    job.wait_for(lambda: _first_step_after(job, 0, g1), 60, "rank 0 trains alone")
    print(f"elastic shrink: SIGKILL of node 1 -> rank 0 training alone: {(_first_step_after(job, 0, g1) or 0) - t_kill:.2f}s")
    resumed = job.resumed(0, g1)
    assert resumed is not None and resumed["step"] is not None, resumed
    # the newest step rank 0 can load alone: its own files and node 1's newest replica on node 0
    replicated = newest_replica(job.memory[0])
    assert replicated is not None
    assert min(replicated, at_kill) - 1 <= resumed["step"] <= min(replicated, at_kill), (resumed, replicated, at_kill)
    assert resumed["digest"] == steps_of(job, 0)[0][resumed["step"]]  # the weights saved at that step, bit for bit
    assert not [e for e in job.events(0) if e["event"] == "warning" and "re-rendezvous" in e.get("what", "")
                and e["generation"] >= g1]
    job.wait_for(lambda: job.last_step(0, generation=g1) >= resumed["step"] + 5, 60, "5 steps alone")
    assert _state(job, 0)["restarts"] == 1
    job.start_agent(1)  # the machine is back: below MAX, the job grows
    grown = job.wait_for(lambda: next((e for e in job.events(0) if e["event"] == "membership"
                                       and e["generation"] > g1), None), 90, "the job grows to 2 nodes")
    assert grown["via"] == "rendezvous" and grown["nnodes"] == 2, grown
    g2 = int(grown["generation"])
    assert job.wait_exit(240) == {0: 0, 1: 0}, job.report()
    restarts = [e for e in job.events(0) if e["event"] == "restart"]
    # the machine's loss reaches node 0 as its worker's failed collective (gloo's peer reset), a
    # symptom; node 1's agent is silent: the diagnosis names node 1 (it was node 0's Crash before)
    assert [e["reason"] for e in restarts][1:] == ["MembershipChange"], restarts
    assert restarts[0]["reason"] == "LostNode", restarts
    lost = next(e for e in job.events(0) if e["event"] == "fault")
    assert (lost["reason"], lost["node"], lost["rank"]) == ("LostNode", 1, None), lost
    assert "no restart counted" in restarts[-1]["why"], restarts[-1]
    st = _state(job, 0)
    assert (st["restarts"], st["membership_changes"]) == (1, 1), st
    both = [job.resumed(r, g2) for r in RANKS]
    assert all(b is not None and b["step"] is not None for b in both), both
    assert both[0]["step"] == both[1]["step"] >= job.last_step(0, generation=g1) - 1, both
    assert both[0]["digest"] == both[1]["digest"]  # one model, loaded alike on both ranks
    assert all(job.last_step(r, generation=g2) == steps for r in RANKS)
