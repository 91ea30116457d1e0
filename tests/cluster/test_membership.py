"""Hot spares and elastic membership of ``tierckpt run`` on namespaced hosts (``hosts.py``): each
host its own address, hostname and ``/dev/shm``; a lost host is ``Host.kill`` (link down, every
process, its memory tier gone), so a peer's address stops answering instead of refusing.

2 nodes x 1 worker of ``tierckpt.demo.resilient``, the rendezvous on host 0, the node agents
hosted by ``tierckpt run --replicas 1 --agent-listen 0.0.0.0:PORT`` (each node's newest memory
step copied to the other host). The loopback versions are ``tests/launcher/test_membership.py``.

- a spare host (``--nnodes 2:2``, started after the job formed) stands by at the spare gate;
  host 1 is killed; the spare takes rank 1 without a full job restart, resumes it from host 0's
  replica bit for bit, and replication runs both ways between the survivor and the spare;
- ``--nnodes 1:2``: host 1 is killed, host 0 goes on alone through the regroup (no rendezvous
  round); a new host arrives, the job grows back to 2 nodes without spending a restart, and the
  new node resumes from host 0's memory over the network.

    nice -n 5 python -m pytest -s -m slow tests/cluster/test_membership.py
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.cluster.hosts import Cluster
from tests.cluster.job import (
    AGENT_PORT,
    MEMORY,
    NS,
    HostJob,
    assert_lost_host_blamed,
    first_step_after,
    newest_replica,
    saved_digests,
    spare_took_rank,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # three launchers on a loaded 2-core box

RANKS = (0, 1)

#: a load from memory or from the surviving peer takes well under a second here; an agent that
#: still lists a lost host waits its 10 s peer deadline (``AgentLimits.peer_deadline_s``)
LOAD_BOUND_S = 5.0
#: a lost host's rank trains again on a waiting spare within this. Not the goal (5 s: 4.5 s
#: measured on an idle box, docs/launcher.md "Hot spares"): a bound that holds beside a CPU hog
#: (9.8 s measured there, on 2 cores with the slow tier's other worker) and still fails the path
#: that blamed the survivor and restarted it first (16.7-30.4 s)
SPARE_BACK_S = 15.0

def _agents(job: HostJob, name: str) -> dict[str, Any]:
    """The ``agent`` event of ``name``'s launcher: its hosted node agent's address."""
    return next(e for e in job.events(name) if e["event"] == "agent")

@pytest.mark.parametrize("rdzv", ["c10d", "tierckpt"])
def test_spare_host_takes_the_lost_hosts_rank(cluster: Cluster, tmp_path: Any, rdzv: str) -> None:
    """``--nnodes 2:2`` on h0 + h1, a spare host h2 started once the job runs; h1 is killed; h2
    takes rank 1 in the next round (no full job restart), resumes it from h0's replica bit for bit,
    and the survivor and the spare replicate to each other afterwards."""
    steps = 200
    h0, h1 = cluster.add_host(), cluster.add_host()
    # 0.3 s steps: the job outlasts the spare's start-up and warm-up on a loaded machine
    job = HostJob(cluster, tmp_path / "job", nnodes="2:2", train=["--steps", str(steps), "--step-time", "0.3"],
                  run_args=["--replicas", "1", f"--agent-listen=0.0.0.0:{AGENT_PORT}"])
    job.rdzv_backend = rdzv  # torch's c10d handler, or ours (membership/rdzv.py)
    job.form([h0, h1])
    h2 = cluster.add_host()  # the round is complete: its launcher can only stand by
    job.start_node(h2, 2)
    spare = job.wait_for(lambda: next((e for e in job.events(h2.name) if e["event"] == "spare"), None), 180,
                         "h2 stands by as a spare")
    assert spare["state"] == "standby" and spare["job_nodes"] == 2, spare
    job.wait_for(lambda: any(e["event"] == "spare" and e["state"] == "warm" for e in job.events(h2.name)), 180,
                 "the spare's standbys finished their imports")
    step_then = min(job.last_step(r) for r in RANKS)
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= step_then + 10, 60, "10 more steps with a spare")
    assert not [e for e in job.events() if e["event"] in ("fault", "restart")], job.report()
    assert {e["generation"] for r in RANKS for e in job.trace(r)} == {0}
    job.wait_for(lambda: newest_replica(h0, f"{NS}--rank1") >= 1, 60, "h0 holds a replica of rank 1")
    replica_at_kill = newest_replica(h0, f"{NS}--rank1")
    at_kill = min(job.last_step(r) for r in RANKS)
    t_kill = time.time()
    h1.kill()
    gen, joined = spare_took_rank(job, h1, h2)
    back = max(first_step_after(job, r, gen) or 0.0 for r in RANKS) - t_kill
    fault = next(e for e in job.events(h0.name) if e["event"] == "fault")
    assert_lost_host_blamed(job, h0, fault, t_kill, node=1)
    # both ranks train again on the spare within seconds (4.5 s measured on an idle box, 9.8 s beside a
    # CPU hog; 16.7-30.4 s before the diagnosis named the lost host): a bound that holds under load
    assert back <= SPARE_BACK_S, (back, job.report())
    codes = job.wait_exit(300, [h0.name, h2.name])
    assert codes == {h0.name: 0, h2.name: 0}, job.report()

    # no full job restart; the survivor kept node 0, the spare holds node 1, with its warm standby
    assert not [e for e in job.events() if e["event"] == "restart" and e.get("kind") == "job"], job.report()
    started = [e for e in job.events(h2.name) if e["event"] == "started"]
    assert started and started[-1]["warm"] == [0], started
    changes = [e for e in job.events(h0.name) if e["event"] == "membership"]
    assert changes and changes[-1]["replaced"] == [{"node": 1, "left": f"{h1.name}:{MEMORY}",
                                                    "by": f"{h2.name}:{MEMORY}"}], changes
    # the lost node cost one restart (a fault), no membership change: the restart-state file
    st = job.state(h0)
    assert (st["restarts"], st["membership_changes"]) == (1, 0), st
    # rank 1 resumed on h2 from h0's replica (its own memory was empty), at the replica's step or newer
    resumed = {r: job.resumed(r, gen) for r in RANKS}
    assert all(v is not None and v["step"] is not None for v in resumed.values()), (resumed, job.report())
    step = resumed[1]["step"]
    assert resumed[0]["step"] == step and replica_at_kill <= step <= at_kill + 1, (resumed, replica_at_kill, at_kill)
    assert "peer" in (resumed[1]["tiers"] or []), resumed
    # the loads did not wait on the lost host's agent: a lost host drops connections, and a peer
    # left in an agent's list cost each load the whole 10 s peer deadline (10.05 s before the fix)
    assert max(resumed[r]["load_s"] for r in RANKS) < LOAD_BOUND_S, resumed
    for r in RANKS:  # bit for bit the state saved at that step before the kill
        assert resumed[r]["digest"] == saved_digests(job, r, gen)[step], f"rank {r}: resumed state differs from step {step}'s"
        assert job.last_step(r, generation=gen) == steps
    # after the replacement both ways replicate: the survivor's newest step reached the spare's
    # host (h0 must have learned h2's agent address), and the spare's reached h0
    assert newest_replica(h2, f"{NS}--rank0") > step, (newest_replica(h2, f"{NS}--rank0"), step, job.report())
    assert newest_replica(h0, f"{NS}--rank1") > step, (newest_replica(h0, f"{NS}--rank1"), step)
    print(f"\nspare host: {fault['reason']} {fault['time'] - t_kill:.2f}s after the kill of {h1.name}; "
          f"{h2.name} ({h2.ip}, agent {_agents(job, h2.name)['address']}) joined as node 1 "
          f"{joined['time'] - t_kill:.2f}s after it (stood by {joined['standby_s']:.1f}s); both ranks training "
          f"again {back:.2f}s after the kill; resumed step {step} (ranks were at {at_kill}, h0's replica of "
          f"rank 1 at {replica_at_kill}; tiers {resumed[1]['tiers']})")

def test_elastic_job_on_hosts_shrinks_by_regroup_and_grows_back(cluster: Cluster, tmp_path: Any) -> None:
    """``--nnodes 1:2`` on h0 + h1: h1 is killed, h0 goes on alone through the regroup (no
    rendezvous round, one restart for the fault); a new host h2 arrives, the job grows back to 2
    nodes at no restart's cost, and h2's rank resumes from h0's memory over the network."""
    steps = 500  # 0.2 s steps: rank 0 still trains alone when the new host's launcher is up
    h0, h1 = cluster.add_host(), cluster.add_host()
    job = HostJob(cluster, tmp_path / "job", nnodes="1:2",
                  train=["--steps", str(steps), "--step-time", "0.2", "--global-mode"],
                  run_args=["--replicas", "1", f"--agent-listen=0.0.0.0:{AGENT_PORT}"])
    job.start([h0, h1])
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= 8, 180, "both ranks reach step 8")
    job.wait_for(lambda: newest_replica(h0, NS) >= 1, 60, "h0 holds a replica of h1's files")
    at_kill = job.last_step(0)
    t_kill = time.time()
    h1.kill()
    fault = job.wait_for(lambda: next((e for e in job.events(h0.name) if e["event"] == "fault"), None), 60,
                         "h0 notices the lost host")
    assert_lost_host_blamed(job, h0, fault, t_kill, node=1)
    shrunk = job.wait_for(lambda: next((e for e in job.events(h0.name) if e["event"] == "membership"), None), 90,
                          "h0 regroups alone")
    assert shrunk["via"] == "regroup" and shrunk["nnodes"] == 1 and shrunk["left"] == [f"{h1.name}:{MEMORY}"], shrunk
    g1 = int(shrunk["generation"])
    job.wait_for(lambda: first_step_after(job, 0, g1), 90, "rank 0 trains alone")
    alone = (first_step_after(job, 0, g1) or 0.0) - t_kill
    resumed = job.resumed(0, g1)
    assert resumed is not None and resumed["step"] is not None, resumed
    assert at_kill - 5 <= resumed["step"] <= at_kill + 1, (resumed, at_kill)  # not from scratch
    assert resumed["digest"] == saved_digests(job, 0, g1)[resumed["step"]]  # the weights saved at that step
    assert resumed["load_s"] < LOAD_BOUND_S, resumed  # not waiting on the lost host's agent (see above)
    assert not [e for e in job.events(h0.name) if e["event"] == "warning" and "re-rendezvous" in e.get("what", "")
                and e["generation"] >= g1]
    job.wait_for(lambda: job.last_step(0, generation=g1) >= resumed["step"] + 5, 60, "5 steps alone")
    assert job.state(h0)["restarts"] == 1

    h2 = cluster.add_host()  # new name, new address, empty /dev/shm: below MAX, the job grows
    t_arrive = time.time()
    job.start_node(h2, 1)
    grown = job.wait_for(lambda: next((e for e in job.events(h0.name) if e["event"] == "membership"
                                       and e["generation"] > g1), None), 180, "the job grows to 2 nodes")
    assert grown["via"] == "rendezvous" and grown["nnodes"] == 2 and grown["joined"] == [f"{h2.name}:{MEMORY}"], grown
    g2 = int(grown["generation"])
    for r in RANKS:
        job.wait_for(lambda r=r: first_step_after(job, r, g2), 120, f"rank {r} trains in generation {g2}")
    both_back = max(first_step_after(job, r, g2) or 0.0 for r in RANKS)
    codes = job.wait_exit(300, [h0.name, h2.name])
    assert codes == {h0.name: 0, h2.name: 0}, job.report()

    restarts = [e for e in job.events(h0.name) if e["event"] == "restart"]
    assert [e["reason"] for e in restarts][1:] == ["MembershipChange"], restarts
    assert restarts[0]["reason"] == "LostNode", restarts  # not the survivor's Hang (issue 25)
    assert "no restart counted" in restarts[-1]["why"], restarts[-1]
    st = job.state(h0)
    assert (st["restarts"], st["membership_changes"]) == (1, 1), st
    both = [job.resumed(r, g2) for r in RANKS]
    assert all(b is not None and b["step"] is not None for b in both), both
    assert both[0]["step"] == both[1]["step"] >= job.last_step(0, generation=g1) - 1, both
    assert both[0]["digest"] == both[1]["digest"] == saved_digests(job, 0, g2)[both[0]["step"]], both
    assert "peer" in (both[1]["tiers"] or []), both  # h2's memory was empty: its files came from h0
    assert max(b["load_s"] for b in both) < LOAD_BOUND_S, both
    assert all(job.last_step(r, generation=g2) == steps for r in RANKS)
    # the grown job replicates both ways again (h0 learned h2's agent address)
    assert newest_replica(h2, NS) > both[0]["step"], (newest_replica(h2, NS), both[0]["step"], job.report())
    assert newest_replica(h0, NS) > both[0]["step"], (newest_replica(h0, NS), both[0]["step"])
    print(f"\nelastic on hosts: kill of {h1.name} -> rank 0 training alone {alone:.2f}s (regroup, resumed step "
          f"{resumed['step']}, was at {at_kill}); {h2.name} started -> both ranks training "
          f"{both_back - t_arrive:.2f}s (resumed step {both[0]['step']}, rank 1 tiers {both[1]['tiers']})")

def test_partitioned_host_is_replaced_by_the_spare_and_stays_out_when_its_link_returns(
        cluster: Cluster, tmp_path: Any) -> None:
    """``--nnodes 2:2`` on h0 + h1 with a spare h2; h1's link goes down (a partition: its processes
    and memory stay); the spare takes rank 1; h1's link comes back: h1 must not disturb the job
    that replaced it (no new round, no second restart), and the job ends with exit 0."""
    steps = 200
    h0, h1 = cluster.add_host(), cluster.add_host()
    job = HostJob(cluster, tmp_path / "job", nnodes="2:2", train=["--steps", str(steps), "--step-time", "0.3"],
                  run_args=["--replicas", "1", f"--agent-listen=0.0.0.0:{AGENT_PORT}"])
    job.form([h0, h1])
    h2 = cluster.add_host()
    job.start_node(h2, 2)
    job.wait_for(lambda: any(e["event"] == "spare" and e["state"] == "warm" for e in job.events(h2.name)), 180,
                 "the spare stands by, warm")
    job.wait_for(lambda: newest_replica(h0, f"{NS}--rank1") >= 1, 60, "h0 holds a replica of rank 1")
    t_cut = time.time()
    h1.link(up=False)
    gen, joined = spare_took_rank(job, h1, h2)
    back = max(first_step_after(job, r, gen) or 0.0 for r in RANKS) - t_cut
    t_heal = time.time()
    h1.link(up=True)
    # h1 finds itself counted lost: it stands by as a spare (the gate), disturbing nothing
    rejoin = job.wait_for(lambda: next((e for e in job.events(h1.name) if e["event"] == "spare"
                                        and e["time"] > t_heal), None), 120, "h1 stands by again")
    assert rejoin["state"] == "standby" and rejoin["job_nodes"] == 2, rejoin
    step_then = min(job.last_step(r, generation=gen) for r in RANKS)
    if step_then < steps - 10:
        job.wait_for(lambda: min(job.last_step(r, generation=gen) for r in RANKS) >= step_then + 10, 90,
                     "10 more steps with h1 back")
    # the job ends without h1; h1's launcher leaves the gate with exit 0 (before: it went straight
    # into torch's round, sat in its redundancy list and died with RendezvousClosedError, exit 1)
    codes = job.wait_exit(300, [h0.name, h2.name, h1.name])
    assert codes == {h0.name: 0, h2.name: 0, h1.name: 0}, job.report()
    survivors = [e for e in job.events(h0.name) + job.events(h2.name) if e["event"] in ("fault", "restart",
                                                                                         "membership")]
    assert {e["generation"] for e in survivors} <= {gen - 1, gen}, job.report()  # one fault, one restart
    assert all(job.last_step(r, generation=gen) == steps for r in RANKS)
    assert not [e for r in RANKS for e in job.trace(r) if e["generation"] > gen], "a round after the replacement"
    print(f"\npartition: {h1.name}'s link down -> {h2.name} joined {joined['time'] - t_cut:.2f}s, both ranks "
          f"training {back:.2f}s; link up -> {h1.name} standing by as a spare {rejoin['time'] - t_heal:.2f}s later; "
          f"its exit: {[e.get('why') for e in job.events(h1.name) if e['event'] == 'exit']}")
