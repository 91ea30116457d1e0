"""Repeat offenders and first-round spares of ``tierckpt run`` on namespaced hosts (``hosts.py``):
each host its own address, hostname and ``/dev/shm`` (its memory tier), ``--nnodes 2:2``, 1 worker
of ``tierckpt.demo.resilient`` per host, the rendezvous on h0, the node agents hosted by
``tierckpt run --replicas 1 --agent-listen 0.0.0.0:PORT``. The loopback versions are
``tests/launcher/test_offenders.py`` and ``tests/launcher/test_first_round.py``.

- repeat offender: h1's worker crashes in two generations in a row (the demo's ``--fault-file``
  on h1's own ``/dev/shm``: only h1's worker sees it, whatever rank it holds; ``--fault-limit 2``
  counted on the shared disk). With ``maxNumRepeatOffendersToAvoid: 1`` h1 stands aside at the
  spare gate and the spare waiting on h2 takes rank 1, resuming it bit for bit from h0's replica;
  with ``0`` h1 is restarted in place and the spare is never used. Every launcher exits 0.
- first-round spare: three launchers on h0, h1, h2 started at once for ``--nnodes 2:2``: exactly
  one stands by at the spare gate (never in torch's redundancy list); a live node's launcher,
  frozen (SIGSTOP to its process alone, by its PID on its host) for longer than torch's keep-alive
  expiry, does not let the spare in: no fault, no restart, one generation, all exit 0.

    nice -n 5 python -m pytest -s -m slow tests/cluster/test_offenders.py
"""

from __future__ import annotations

import time
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
from tests.launcher.cluster import offenders_job_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # three launchers on a loaded 2-core box

RANKS = (0, 1)
#: on h1's own tmpfs: h0's and h2's workers never see it (the hosts share the disk, not /dev/shm)
CRASH_FILE = "/dev/shm/crash-now"
OFFENDER_STEPS = 300  # 0.3 s each: the job outlasts the spare's start-up and two restarts
FIRST_ROUND_STEPS = 220  # 0.2 s each: the job outlasts three launchers' start-up and the freeze
FREEZE_S = 8.0  # > torch's keep-alive expiry under tierckpt run (1 s x 3), < --node-timeout (20 s)


def _ident(host: Host) -> str:
    return f"{host.name}:{MEMORY}"


def _faults(job: HostJob, host: Host) -> list[dict[str, Any]]:
    return [e for e in job.events(host.name) if e["event"] == "fault"]


def _after(events: list[dict[str, Any]], t0: float) -> str:
    return ", ".join(f"{e['time'] - t0:.2f}s" for e in events)


def _two_crashes_on_h1(cluster: Cluster, tmp_path: Path, max_avoid: int) -> tuple[HostJob, Host, Host, Host, float]:
    """h0 + h1 form the job, a spare on h2 stands by warm, h0 holds a replica of rank 1; then h1's
    worker crashes in generation 0 and again at its first step of generation 1. The job, the
    hosts and when the crash file appeared."""
    h0, h1 = cluster.add_host(), cluster.add_host()
    # every host's memory tier is MEMORY, so --fault-memory-dir names every node: the file decides
    job = HostJob(cluster, tmp_path / "job", nnodes="2:2",
                  train=["--steps", str(OFFENDER_STEPS), "--step-time", "0.3", "--fault", "exit",
                         "--fault-generation", "-1", "--fault-file", CRASH_FILE, "--fault-limit", "2",
                         "--fault-memory-dir", MEMORY],
                  run_args=["--replicas", "1", f"--agent-listen=0.0.0.0:{AGENT_PORT}",
                            f"--job={offenders_job_file(tmp_path, max_avoid)}"])
    t0 = time.time()
    job.form([h0, h1])
    h2 = cluster.add_host()  # the job is full: its launcher can only stand by at the gate
    job.start_node(h2, 2)
    spare = job.wait_for(lambda: next((e for e in job.events(h2.name) if e["event"] == "spare"), None), 180,
                         "h2 stands by as a spare")
    assert spare["state"] == "standby" and spare["job_nodes"] == 2, spare
    job.wait_for(lambda: any(e["event"] == "spare" and e["state"] == "warm" for e in job.events(h2.name)), 180,
                 "the spare's standbys finished their imports")
    job.wait_for(lambda: newest_replica(h0, f"{NS}--rank1") >= 1, 60, "h0 holds a replica of rank 1")
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= 5, 60, "both ranks reach step 5")
    assert job.last_step(0) < OFFENDER_STEPS - 100, "the job trained too far before the spare stood by; raise STEPS"
    print(f"\njob formed and the spare warm {time.time() - t0:.1f}s after the first launcher started")
    t_file = time.time()
    h1.run(["touch", CRASH_FILE])
    job.wait_for(lambda: len(_faults(job, h0)) >= 2, 120, "two faults reach h0")
    assert h0.run(["test", "-e", CRASH_FILE], check=False).returncode != 0  # the file is h1's alone
    return job, h0, h1, h2, t_file


def test_repeat_offender_host_stands_aside_and_the_spare_host_takes_its_rank(cluster: Cluster,
                                                                            tmp_path: Path) -> None:
    job, h0, h1, h2, t_file = _two_crashes_on_h1(cluster, tmp_path, max_avoid=1)
    offender = job.wait_for(lambda: next((e for e in job.events(h1.name) if e["event"] == "offender"), None), 60,
                            "h1 reports itself a repeat offender")
    assert offender["identity"] == _ident(h1) and offender["faults"] == 2 and offender["spares"] == 1, offender
    assert [e["identity"] for e in job.events(h0.name) if e["event"] == "offender"] == [_ident(h1)]
    gen, joined = spare_took_rank(job, h1, h2)
    aside = [e for e in job.events(h1.name) if e["event"] == "spare" and e["state"] == "standby"]
    assert aside and aside[0]["identity"] == _ident(h1) and aside[0]["job_nodes"] == 2, job.report()
    faults = _faults(job, h0)
    back = max(first_step_after(job, r, gen) or 0.0 for r in RANKS)
    codes = job.wait_exit(300, [h0.name, h1.name, h2.name])
    assert codes == {h0.name: 0, h1.name: 0, h2.name: 0}, job.report()

    exit1 = [e for e in job.events(h1.name) if e["event"] == "exit"]
    assert exit1 and exit1[-1]["code"] == 0 and "spare" in exit1[-1].get("why", ""), exit1  # stood by to the end
    assert [(e["reason"], e["node"], e["rank"]) for e in faults] == [("Crash", 1, 1)] * 2, faults
    assert not [e for e in job.events() if e["event"] == "restart" and e.get("kind") == "job"], job.report()
    # h1 ran no worker after it stood aside; the spare's workers hold rank 1 from then on
    assert not [e for e in job.events(h1.name) if e["event"] == "started" and e["time"] > offender["time"]]
    started = [e for e in job.events(h2.name) if e["event"] == "started"]
    assert started and started[-1]["node"] == 1, started
    changes = [e for e in job.events(h0.name) if e["event"] == "membership"]
    assert changes and changes[-1]["replaced"] == [{"node": 1, "left": _ident(h1), "by": _ident(h2)}], changes
    # two faults, each a process restart; the replacement is no membership change of its own
    st = job.state(h0)
    assert (st["restarts"], st["membership_changes"]) == (2, 0), st
    # generation 1 (h1 restarted in place) resumed rank 1 from h1's own memory; generation ``gen``
    # (the spare) from h0's replica: h2's /dev/shm held nothing of the job
    first = job.resumed(1, 1)
    assert first is not None and first["step"] is not None and "peer" not in (first["tiers"] or []), first
    assert first["digest"] == saved_digests(job, 1, 1)[first["step"]], first
    resumed = {r: job.resumed(r, gen) for r in RANKS}
    assert all(v is not None and v["step"] is not None for v in resumed.values()), (resumed, job.report())
    step = resumed[1]["step"]
    assert resumed[0]["step"] == step and "peer" in (resumed[1]["tiers"] or []), resumed
    for r in RANKS:  # bit for bit the state saved at that step before the spare came in
        assert resumed[r]["digest"] == saved_digests(job, r, gen)[step], f"rank {r}: resumed state differs at {step}"
        assert job.last_step(r, generation=gen) == OFFENDER_STEPS
    print(f"repeat offender on hosts: crash file on {h1.name} -> faults at {_after(faults, t_file)}; {h2.name} joined as node 1 at "
          f"{joined['time'] - t_file:.2f}s (generation {gen}, stood by {joined['standby_s']:.1f}s); both ranks "
          f"training {back - t_file:.2f}s after the file, {back - faults[-1]['time']:.2f}s after the second fault; "
          f"rank 1 resumed step {step} from {resumed[1]['tiers']} in {resumed[1]['load_s']:.2f}s "
          f"(generation 1 in place: step {first['step']} from {first['tiers']})")


def test_without_the_policy_the_offender_host_restarts_in_place(cluster: Cluster, tmp_path: Path) -> None:
    job, h0, h1, h2, t_file = _two_crashes_on_h1(cluster, tmp_path, max_avoid=0)
    codes = job.wait_exit(300, [h0.name, h1.name, h2.name])
    assert codes == {h0.name: 0, h1.name: 0, h2.name: 0}, job.report()
    faults = _faults(job, h0)
    assert [(e["reason"], e["node"], e["rank"]) for e in faults] == [("Crash", 1, 1)] * 2, faults
    assert not [e for e in job.events() if e["event"] in ("offender", "membership")], job.report()
    assert not [e for e in job.events(h2.name) if e["event"] == "started"
                or (e["event"] == "spare" and e["state"] == "joined")], job.report()  # the spare never ran workers
    exit2 = [e for e in job.events(h2.name) if e["event"] == "exit"]
    assert exit2 and exit2[-1]["code"] == 0 and "spare" in exit2[-1].get("why", ""), exit2
    ranks1 = [e["node"] for e in job.events(h1.name) if e["event"] in ("started", "restart")]
    assert ranks1 and set(ranks1) == {1}, ranks1  # h1 kept rank 1 in every generation
    st = job.state(h0)
    assert (st["restarts"], st["membership_changes"]) == (2, 0), st
    for g in (1, 2):  # each restart in place resumed rank 1 from h1's own memory, bit for bit
        got = job.resumed(1, g)
        assert got is not None and got["step"] is not None and "peer" not in (got["tiers"] or []), (g, got)
        assert got["digest"] == saved_digests(job, 1, g)[got["step"]], (g, got)
    assert all(job.last_step(r) == OFFENDER_STEPS for r in RANKS)
    back = first_step_after(job, 1, 2) or 0.0
    print(f"no policy on hosts: faults at {_after(faults, t_file)} after the crash file on {h1.name}; rank 1 training in place again {back - faults[-1]['time']:.2f}s after the "
          f"second; {h2.name} stood by to the end")


def _standing_by(job: HostJob, hosts: list[Host]) -> list[Host]:
    return [h for h in hosts if any(e["event"] == "spare" and e["state"] == "standby" for e in job.events(h.name))]


def _group_rank(job: HostJob, host: Host) -> int:
    """The group rank ``host``'s launcher held in its newest started/restart event."""
    return int([e for e in job.events(host.name) if e["event"] in ("started", "restart")][-1]["node"])


def test_first_round_spare_host_stands_by_through_a_frozen_launcher(cluster: Cluster, tmp_path: Path) -> None:
    hosts = [cluster.add_host() for _ in range(3)]
    h0 = hosts[0]
    job = HostJob(cluster, tmp_path / "job", nnodes="2:2", node_timeout=20.0,
                  train=["--steps", str(FIRST_ROUND_STEPS), "--step-time", "0.2"],
                  run_args=["--replicas", "1", f"--agent-listen=0.0.0.0:{AGENT_PORT}"])
    t0 = time.time()
    job.start(hosts)  # all three at once: none of them knows yet whether the job is full
    spares = job.wait_for(lambda: _standing_by(job, hosts), 180, "one launcher stands by as a spare")
    live = [h for h in hosts if h not in spares]
    job.wait_for(lambda: all(any(e["event"] == "started" for e in job.events(h.name)) for h in live), 180,
                 "the other two form the job")
    assert len(spares) == 1 and len(live) == 2, job.report()
    spare = spares[0]
    first = next(e for e in job.events(spare.name) if e["event"] == "spare")
    # seated out before the round formed (0), or, when tierckpt's rendezvous closed the round at MAX the
    # moment the first two arrived, after it (2): either way a spare, never a member
    assert first["state"] == "standby" and first["job_nodes"] in (0, 2), first
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= 5, 120, "both ranks reach step 5")
    t_formed = time.time()
    ranks_before = {h.name: _group_rank(job, h) for h in live}
    assert sorted(ranks_before.values()) == [0, 1], ranks_before
    # freeze a live launcher that does not host the store (h0's does: freezing it freezes the store)
    frozen = max((h for h in live if h is not h0), key=lambda h: h.index)
    pid = job.freeze_launcher(frozen)
    try:
        time.sleep(FREEZE_S)  # the fault's duration, not a check
        state = frozen.run(["sh", "-c", f"cut -d' ' -f3 /proc/{pid}/stat"]).stdout.strip()
    finally:
        job.thaw_launcher(frozen, pid)
    assert state == "T", f"the launcher (pid {pid} on {frozen.name}) was not stopped: state {state!r}"
    step_then = min(job.last_step(r) for r in RANKS)
    assert step_then < FIRST_ROUND_STEPS - 10, "the job trained too far before the freeze ended; raise STEPS"
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= step_then + 10, 90, "10 more steps after the freeze")
    codes = job.wait_exit(300, [h.name for h in hosts])
    assert codes == {h.name: 0 for h in hosts}, job.report()
    # nothing happened: no fault, no restart, one generation; the spare never took a rank
    assert not [e for e in job.events() if e["event"] in ("fault", "restart", "membership")], job.report()
    assert {e["generation"] for r in RANKS for e in job.trace(r)} == {0}
    assert not [e for e in job.events(spare.name) if e["event"] in ("started", "stopped")
                or (e["event"] == "spare" and e["state"] == "joined")], job.report()
    assert {h.name: _group_rank(job, h) for h in live} == ranks_before
    exit_ev = [e for e in job.events(spare.name) if e["event"] == "exit"]
    assert exit_ev and exit_ev[-1]["code"] == 0 and "spare" in exit_ev[-1].get("why", ""), exit_ev
    assert all(job.last_step(r) == FIRST_ROUND_STEPS for r in RANKS)
    print(f"\nfirst-round spare on hosts: {spare.name} stood by (job_nodes 0) {first['time'] - t0:.1f}s after the "
          f"start; both ranks at step 5 {t_formed - t0:.1f}s; {frozen.name}'s launcher (pid {pid} there) frozen "
          f"{FREEZE_S:g}s without a fault or a restart")
