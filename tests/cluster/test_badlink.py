"""A lost host resumes from the peer replica over bad links: 20 ms delay and 1 % loss on every link.

The scenario of ``test_run.py`` (2 nodes x 1 worker of ``tierckpt.demo.resilient``, ``tierckpt
run --replicas 1``, host 1 killed, a replacement host with a new name and address as node 1),
twice in one test: on clean links, then with every host's egress (the replacement's too) shaped
by ``Host.shape(delay_ms=20, loss_pct=1)`` (netem, or the iptables/NFQUEUE fallback). Both must
replicate to the peer and resume from it at the same step on both ranks, bitwise; the printed
line compares the recovery times.

    nice -n 5 python -m pytest -s -m slow tests/cluster/test_badlink.py
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.hosts import Cluster, Host
from tests.cluster.job import AGENT_PORT, HostJob, assert_lost_host_blamed, newest_replica

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # two jobs of ~2 min each, more on a loaded box

RANKS = (0, 1)
STEPS = 60
DELAY_MS, LOSS_PCT = 20, 1


def test_lost_host_resumes_from_the_peer_replica_over_delayed_lossy_links(cluster: Cluster, tmp_path: Path) -> None:
    missing = cluster.shaping_missing()
    if missing:
        pytest.skip(missing)
    clean = _scenario(cluster, tmp_path / "clean", bad=False)
    bad = _scenario(cluster, tmp_path / "bad", bad=True)
    print(f"\nlost host, clean links vs every link with {DELAY_MS} ms delay + {LOSS_PCT} % loss "
          f"({bad['mechanism']}):")
    print("| seconds after the kill | clean | bad |\n|---|---|---|")
    for key in ("fault", "replacement up", "rank 1 interpreter", "torch imported", "process group", "resumed",
                "first step"):
        print(f"| {key} | {clean[key]:.2f} | {bad[key]:.2f} |")
    for what, since, until in (("process group formed (rank 1 interpreter -> process group)", "rank 1 interpreter",
                                "process group"),
                               ("restore from the peer (process group -> resumed)", "process group", "resumed")):
        print(f"| {what}, s | {clean[until] - clean[since]:.2f} | {bad[until] - bad[since]:.2f} |")
    print(f"resumed step: clean {clean['step']} (replica {clean['replica_step']}), "
          f"bad {bad['step']} (replica {bad['replica_step']}); "
          f"delayer: {bad['delayer_counts']}")
    # the bad links really carried the job's traffic through the delayer (the fallback), or netem did
    if bad["mechanism"].startswith("nfqueue"):
        assert all(c["queued"] > 100 and c["accepted"] == c["queued"] for c in bad["delayer_counts"]), bad


def _scenario(cluster: Cluster, tmp: Path, *, bad: bool) -> dict[str, Any]:
    def shape(h: Host) -> str:
        return h.shape(delay_ms=DELAY_MS, loss_pct=LOSS_PCT) if bad else ""

    h0, h1 = cluster.add_host(), cluster.add_host()
    mechanism = shape(h0)
    shape(h1)
    job = HostJob(cluster, tmp, train=["--steps", str(STEPS), "--global-mode"],
                  run_args=["--replicas", "1", f"--agent-listen=0.0.0.0:{AGENT_PORT}"])
    job.start([h0, h1])
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= 8, 240, "both ranks reach step 8")
    job.wait_for(lambda: newest_replica(h0) >= 1, 120, "host 0 holds a replica of node 1")
    replica_step = newest_replica(h0)
    t_kill = time.time()
    h1.kill()
    fault = job.wait_for(lambda: next((e for e in job.events(h0.name) if e["event"] == "fault"), None),
                         90, "the survivor notices the lost host")
    assert_lost_host_blamed(job, h0, fault, t_kill, node=1)  # bad links too: 1 % loss never silences an agent 1.5 s
    h2 = cluster.add_host()
    shape(h2)
    t_replacement = time.time() - t_kill
    job.start_node(h2, 1)
    codes = job.wait_exit(300, [h0.name, h2.name])
    assert codes == {h0.name: 0, h2.name: 0}, job.report()

    gen, resumed = job.resumed_last(RANKS)
    step = resumed[0]["step"]
    assert resumed[1]["step"] == step and step >= replica_step >= 1, (resumed, replica_step)
    assert "peer" in (resumed[1]["tiers"] or []), resumed  # the replacement's own memory was empty
    for r in RANKS:
        saved = {e["step"]: e["digest"] for e in job.trace(r) if e["event"] == "step" and e["generation"] < gen}
        assert resumed[r]["digest"] == saved[step], f"rank {r}: resumed state differs from step {step}'s"
        assert job.last_step(r, generation=gen) == STEPS
    t = {e["event"]: e["time"] - t_kill for e in job.trace(1) if e["generation"] == gen
         and e["event"] in ("start", "imported", "pg", "resumed")}
    first_step = min(e["time"] for e in job.trace(1) if e["event"] == "step" and e["generation"] == gen)
    faults = [h.fault for h in (h0, h2) if h.fault is not None]
    for h in (h0, h2):
        h.kill()  # clears the shaping: the delayers report what they carried
    out = {"mechanism": mechanism, "step": step, "replica_step": replica_step, "fault": fault["time"] - t_kill,
           "replacement up": t_replacement, "rank 1 interpreter": t.get("start", -1.0),
           "torch imported": t.get("imported", -1.0), "process group": t.get("pg", -1.0),
           "resumed": t.get("resumed", -1.0), "first step": first_step - t_kill,
           "delayer_counts": [f.delayer_counts for f in faults if bad]}
    print(f"\n{'bad' if bad else 'clean'} links: {out}", flush=True)
    return out
