"""Bad nodes leave before they fail the job (issue 28 item 6), on namespaced hosts (``hosts.py``).

``--nnodes 2:2`` on h0 + h1 with a spare h2 at the gate, 1 worker each of ``tierckpt.demo.resilient``
(a memory-tier save every step, replicated to the peer host by the hosted node agents). Every
launcher runs the health monitor at a 1 s interval with the built-in checks (nic, memfs on its
/dev/shm). Then h1 turns unhealthy, one way per test:

- its ``--health-check`` command fails once a file named after its host appears on the shared
  disk: the site's own node check turning red;
- its second NIC ``eth1`` (every host has one, on a fabric of its own: the storage network;
  gloo and the rendezvous stay on ``eth0``), watched with ``--health-nic eth0 --health-nic eth1``,
  loses carrier. A host whose only link goes is a lost node (test_membership.py), not this.

Either way h1 must leave at its next step boundary, within ``DRAIN_ROUNDS`` health intervals,
without a fault (no ``fault`` event anywhere, no restart counted, no offense), the spare must take
rank 1 and resume at the newest step bit for bit, and every launcher must exit 0 (h1 stood aside
at the spare gate).

    nice -n 5 python -m pytest -s -m slow tests/cluster/test_health.py
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.hosts import Cluster, Host
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
INTERVAL_S = 1.0
#: h1 is drained within this many health intervals of turning bad: ``--health-fail-after`` (2)
#: failing rounds, the round in flight when it turned, and one for the step boundary (0.3 s steps)
DRAIN_ROUNDS = 4


@dataclass(frozen=True)
class Drained:
    """What ``drain_to_spare`` saw; times are seconds since h1 turned bad."""

    job: HostJob
    h1: Host  # the host that turned bad
    unhealthy: dict[str, Any]  # h1's first ``health`` event with status ``unhealthy``
    drain: dict[str, Any]  # h0's ``drain`` event with state ``left``
    to_unhealthy: float
    to_drain: float
    to_joined: float
    to_training: float  # both ranks stepping again
    step: int  # the step both ranks resumed at
    last_before: int  # the newest step every rank had trained before the drain
    tiers: Any  # where rank 1's state came from

    def line(self, what: str) -> str:
        return (f"\nhealth drain: {what} at t=0; unhealthy at {self.to_unhealthy:.2f}s, drained at step "
                f"{self.drain['step']} {self.to_drain:.2f}s, the spare joined as node 1 {self.to_joined:.2f}s, "
                f"both ranks training again {self.to_training:.2f}s; resumed step {self.step} (ranks were at "
                f"{self.last_before}; tiers {self.tiers})")


def drain_to_spare(cluster: Cluster, tmp_path: Path, *, run_args: Sequence[str], watched: str,
                   turn_bad: Callable[[Host], None], nics: Sequence[str] = ()) -> Drained:
    """The scenario of the module doc: every host gets ``nics`` (``Host.add_nic``), the launchers
    ``run_args`` besides the job's own; h1's monitor must list ``watched`` among its checks; then
    ``turn_bad(h1)``, and every check that holds for any cause of the drain."""
    steps = 200

    def host() -> Host:
        made = cluster.add_host()
        for nic in nics:
            made.add_nic(nic)
        return made

    h0, h1 = host(), host()
    job = HostJob(cluster, tmp_path / "job", nnodes="2:2", train=["--steps", str(steps), "--step-time", "0.3"],
                  run_args=["--replicas", "1", f"--agent-listen=0.0.0.0:{AGENT_PORT}",
                            "--health-interval", str(INTERVAL_S), *run_args])
    job.form([h0, h1])
    h2 = host()
    job.start_node(h2, 2)
    job.wait_for(lambda: any(e["event"] == "spare" and e["state"] == "warm" for e in job.events(h2.name)), 180,
                 "the spare's standbys finished their imports")
    step_then = min(job.last_step(r) for r in RANKS)
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= step_then + 5, 60, "5 more steps with a spare")
    job.wait_for(lambda: newest_replica(h0, f"{NS}--rank1") >= 1, 60, "h0 holds a replica of rank 1")
    watching = [e for e in job.events(h1.name) if e["event"] == "health" and e["status"] == "watching"]
    assert watching and watched in watching[0]["checks"], watching
    assert not [e for e in job.events() if e["event"] in ("fault", "restart", "drain")], job.report()
    # every check passes on every host before (a host reads its own /sys/class/net: hostinit.py)
    assert not [e for e in job.events() if e["event"] == "health" and e["status"] != "watching"], job.report()

    t_bad = time.time()
    turn_bad(h1)
    gen, joined = spare_took_rank(job, h1, h2)
    back = max(first_step_after(job, r, gen) or 0.0 for r in RANKS) - t_bad
    codes = job.wait_exit(300, [h0.name, h1.name, h2.name])
    assert codes == {h0.name: 0, h1.name: 0, h2.name: 0}, job.report()

    events = job.events()
    assert not [e for e in events if e["event"] == "fault"], job.report()  # a drain is no fault
    assert not [e for e in events if e["event"] == "restart" and e.get("kind") == "job"], job.report()
    unhealthy = next(e for e in job.events(h1.name) if e["event"] == "health" and e["status"] == "unhealthy")
    left = {e["host"]: e for e in events if e["event"] == "drain" and e["state"] == "left"}
    assert set(left) >= {h0.name, h1.name}, job.report()  # every node of the job reports it
    drain = left[h0.name]
    assert drain["node"] == 1 and drain["identity"] == f"{h1.name}:{MEMORY}" and drain["at"] == "step boundary", drain
    assert drain["time"] - t_bad <= DRAIN_ROUNDS * INTERVAL_S, (drain["time"] - t_bad, drain, unhealthy)
    restarts = [e for e in job.events(h0.name) if e["event"] == "restart"]
    assert [e["reason"] for e in restarts] == ["Drain"] and "no restart counted" in restarts[0]["why"], restarts
    st = job.state(h0)
    assert (st["restarts"], st["membership_changes"], st.get("offenses") or {}) == (0, 1, {}), st
    # h1 stood aside at the spare gate (no rank) and left when the job finished
    assert [e for e in job.events(h1.name) if e["event"] == "spare" and e["state"] == "standby"], job.report()
    # the healthy hosts stayed healthy: not one check failed a round there
    assert not [e for e in job.events(h0.name) + job.events(h2.name)
                if e["event"] == "health" and e["status"] != "watching"], job.report()

    step, last_before, resumed = resumed_at_boundary(job, int(drain["step"]), gen, steps)
    return Drained(job, h1, unhealthy, drain, unhealthy["time"] - t_bad, drain["time"] - t_bad,
                   joined["time"] - t_bad, back, step, last_before, resumed[1]["tiers"])


def resumed_at_boundary(job: HostJob, boundary: int, gen: int,
                        steps: int) -> tuple[int, int, dict[int, dict[str, Any]]]:
    """The spare resumed rank 1 at the step ``boundary`` the drain waited for (or the one committed
    while the workers stopped), bit for bit what was saved there, nothing trained before it lost,
    and every rank finished; (that step, the newest step all ranks trained before generation
    ``gen``, the ``resumed`` events by rank)."""
    last_before = min(max(e["step"] for e in job.trace(r) if e["event"] == "step" and e["generation"] < gen)
                      for r in RANKS)
    resumed = {r: job.resumed(r, gen) for r in RANKS}
    got = {r: v for r, v in resumed.items() if v is not None and v["step"] is not None}
    assert len(got) == len(RANKS), (resumed, job.report())
    step = int(got[1]["step"])
    assert got[0]["step"] == step and boundary <= step <= boundary + 1, (resumed, boundary)
    assert step >= last_before - 1, (step, last_before)  # at most the step in flight is redone
    for r in RANKS:
        assert got[r]["digest"] == saved_digests(job, r, gen)[step], f"rank {r}: resumed state differs"
        assert job.last_step(r, generation=gen) == steps
    return step, last_before, got


def test_a_host_whose_health_check_fails_leaves_for_the_spare_without_a_fault(cluster: Cluster,
                                                                             tmp_path: Path) -> None:
    flags = tmp_path / "flags"
    flags.mkdir()
    got = drain_to_spare(cluster, tmp_path, run_args=["--health-check", f"test ! -e {flags}/unhealthy-$(hostname)"],
                         watched="nic(eth0)",  # gloo's interface, by default
                         turn_bad=lambda h1: (flags / f"unhealthy-{h1.name}").touch())
    assert got.unhealthy["check"] == "command" and "exit 1" in got.unhealthy["detail"], got.unhealthy
    print(got.line("h1's check failed"))


def test_a_host_whose_second_nic_loses_carrier_leaves_for_the_spare_without_a_fault(cluster: Cluster,
                                                                                   tmp_path: Path) -> None:
    got = drain_to_spare(cluster, tmp_path, run_args=["--health-nic", "eth0", "--health-nic", "eth1"],
                         watched="nic(eth0,eth1)", nics=["eth1"],
                         turn_bad=lambda h1: h1.nic_carrier("eth1", up=False))
    bad = got.unhealthy
    assert (bad["check"], bad["subject"]) == ("nic", "eth1") and "carrier down" in bad["detail"], bad
    assert "eth1" in got.drain["detail"] and "carrier" in got.drain["detail"], got.drain
    # eth1 alone went bad on h1 (gloo's eth0 carried on: no lost node)
    assert {e["subject"] for e in got.job.events(got.h1.name) if e["event"] == "health"
            and e["status"] in ("failing", "unhealthy")} == {"eth1"}, got.job.report()
    print(got.line("h1's eth1 lost carrier"))
