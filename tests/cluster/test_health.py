"""Bad nodes leave before they fail the job (issue 28 item 6), on namespaced hosts (``hosts.py``).

``--nnodes 2:2`` on h0 + h1 with a spare h2 at the gate, 1 worker each of ``tierckpt.demo.resilient``
(a memory-tier save every step, replicated to the peer host by the hosted node agents). Every
launcher runs the health monitor at a 1 s interval with the built-in checks (nic on eth0, memfs on
its /dev/shm) and one ``--health-check`` command that fails once a file named after its host
appears on the shared disk: the site's own node check turning red on h1. h1 must leave at its
next step boundary without a fault (no ``fault`` event anywhere, no restart counted, no offense),
the spare must take rank 1 and resume at the newest step bit for bit, and every launcher must exit
0 (h1 stood aside at the spare gate).

    nice -n 5 python -m pytest -s -m slow tests/cluster/test_health.py
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.cluster.hosts import Cluster
from tests.cluster.job import (
    AGENT_PORT,
    MEMORY,
    NS,
    HostJob,
    first_step_after,
    newest_replica,
    saved_digests,
    spare_took_rank,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RANKS = (0, 1)


def test_a_host_whose_health_check_fails_leaves_for_the_spare_without_a_fault(cluster: Cluster,
                                                                             tmp_path: Path) -> None:
    steps = 200
    flags = tmp_path / "flags"
    flags.mkdir()
    h0, h1 = cluster.add_host(), cluster.add_host()
    check = f"test ! -e {flags}/unhealthy-$(hostname)"
    job = HostJob(cluster, tmp_path / "job", nnodes="2:2", train=["--steps", str(steps), "--step-time", "0.3"],
                  run_args=["--replicas", "1", f"--agent-listen=0.0.0.0:{AGENT_PORT}", "--health-interval", "1",
                            "--health-check", check])
    job.form([h0, h1])
    h2 = cluster.add_host()
    job.start_node(h2, 2)
    job.wait_for(lambda: any(e["event"] == "spare" and e["state"] == "warm" for e in job.events(h2.name)), 180,
                 "the spare's standbys finished their imports")
    step_then = min(job.last_step(r) for r in RANKS)
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= step_then + 5, 60, "5 more steps with a spare")
    job.wait_for(lambda: newest_replica(h0, f"{NS}--rank1") >= 1, 60, "h0 holds a replica of rank 1")
    watching = [e for e in job.events(h1.name) if e["event"] == "health" and e["status"] == "watching"]
    assert watching and any("nic(eth0)" == c for c in watching[0]["checks"]), watching  # gloo's interface
    assert not [e for e in job.events() if e["event"] in ("fault", "restart", "drain")], job.report()

    t_bad = time.time()
    (flags / f"unhealthy-{h1.name}").touch()
    gen, joined = spare_took_rank(job, h1, h2)
    back = max(first_step_after(job, r, gen) or 0.0 for r in RANKS) - t_bad
    codes = job.wait_exit(300, [h0.name, h1.name, h2.name])
    assert codes == {h0.name: 0, h1.name: 0, h2.name: 0}, job.report()

    events = job.events()
    assert not [e for e in events if e["event"] == "fault"], job.report()  # a drain is no fault
    assert not [e for e in events if e["event"] == "restart" and e.get("kind") == "job"], job.report()
    unhealthy = next(e for e in job.events(h1.name) if e["event"] == "health" and e["status"] == "unhealthy")
    assert unhealthy["check"] == "command" and "exit 1" in unhealthy["detail"], unhealthy
    left = {e["host"]: e for e in events if e["event"] == "drain" and e["state"] == "left"}
    assert set(left) >= {h0.name, h1.name}, job.report()  # every node of the job reports it
    drain = left[h0.name]
    assert drain["node"] == 1 and drain["identity"] == f"{h1.name}:{MEMORY}" and drain["at"] == "step boundary", drain
    restarts = [e for e in job.events(h0.name) if e["event"] == "restart"]
    assert [e["reason"] for e in restarts] == ["Drain"] and "no restart counted" in restarts[0]["why"], restarts
    st = job.state(h0)
    assert (st["restarts"], st["membership_changes"], st.get("offenses") or {}) == (0, 1, {}), st
    # h1 stood aside at the spare gate (no rank) and left when the job finished
    assert [e for e in job.events(h1.name) if e["event"] == "spare" and e["state"] == "standby"], job.report()

    # the spare resumed rank 1 at the step boundary the drain waited for (or the one committed while
    # the workers stopped), bit for bit what was saved there; nothing trained before it was lost
    boundary = int(drain["step"])
    last_before = min(max(e["step"] for e in job.trace(r) if e["event"] == "step" and e["generation"] < gen)
                      for r in RANKS)
    resumed = {r: job.resumed(r, gen) for r in RANKS}
    assert all(v is not None and v["step"] is not None for v in resumed.values()), (resumed, job.report())
    step = resumed[1]["step"]
    assert resumed[0]["step"] == step and boundary <= step <= boundary + 1, (resumed, boundary)
    assert step >= last_before - 1, (step, last_before)  # at most the step in flight is redone
    for r in RANKS:
        assert resumed[r]["digest"] == saved_digests(job, r, gen)[step], f"rank {r}: resumed state differs"
        assert job.last_step(r, generation=gen) == steps
    print(f"\nhealth drain: {h1.name}'s check failed at t=0; unhealthy at {unhealthy['time'] - t_bad:.2f}s, "
          f"drained at step {boundary} {drain['time'] - t_bad:.2f}s, {h2.name} joined as node 1 "
          f"{joined['time'] - t_bad:.2f}s, both ranks training again {back:.2f}s; resumed step {step} "
          f"(ranks were at {last_before}; tiers {resumed[1]['tiers']})")
