"""A lost host's state restored onto its replacement while the replacement starts, on capped links.

2 nodes x 1 worker of ``tierckpt.demo.resilient`` in local mode with a ``--ballast-mib`` buffer
(so each rank's state is tens of MiB), ``tierckpt run --replicas 1``, every host's egress capped
by ``tc tbf`` (the network, not the CPU, is the limit). Host 1 is killed; a replacement host
(new name, new address, empty ``/dev/shm``) takes node 1. Its agent prefetches node 1's state
from host 0's replica as soon as the rendezvous gave it its rank, while its worker starts; the
worker's load finds it cached (or waits for the file in flight). The same scenario with the
prefetch off (``TIERCKPT_PREFETCH=0``, today's path: the worker fetches at load time) is the
baseline, and a plain socket copy of the same bytes from host 0 to the replacement over the same
capped link is the yardstick. Printed: the table that docs/benchmarks.md quotes.

    nice -n 5 python -m pytest -s -m slow tests/cluster/test_restore.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.hosts import Cluster, Host
from tests.cluster.job import AGENT_PORT, NS, HostJob, assert_lost_host_blamed, newest_replica

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # two jobs of ~2 min each, more on a loaded box

RANKS = (0, 1)
STEPS = 45
BALLAST_MIB = 32
RATE_MBIT = 100  # 32 MiB → ~2.8 s on the wire
SOCKCOPY = Path(__file__).with_name("sockcopy.py")


def test_replacement_prefetches_the_lost_hosts_state_while_its_workers_start(cluster: Cluster, tmp_path: Path) -> None:
    base = _scenario(cluster, tmp_path / "baseline", prefetch=False)
    pre = _scenario(cluster, tmp_path / "prefetch", prefetch=True)
    copy_s = pre["copy_s"]
    rows = [("plain socket copy of the same bytes (host 0 -> replacement)", copy_s, copy_s),
            ("today: the load's fetch requests waited (restore visible after the workers are ready)",
             base["wait_s"], base["copy_s"]),
            ("with the prefetch on join: the same wait", pre["wait_s"], copy_s),
            ("today: rank 1's whole load (agreement, reads, checks, the wait)", base["load_s"], base["copy_s"]),
            ("with the prefetch on join: rank 1's whole load", pre["load_s"], copy_s)]
    print(f"\nrestore of a lost host's state on its replacement: {pre['bytes'] / 2**20:.1f} MiB per rank, "
          f"links capped at {RATE_MBIT} Mbit/s (tc tbf)")
    for what, value, yardstick in rows:
        print(f"| {what} | {value:.2f} s | {value / yardstick:.2f} x |")
    print(f"prefetch: began {pre['prefetch_lead_s']:.2f} s before rank 1's load, took {pre['prefetch_s']:.2f} s; "
          f"rank 1's load began {pre['load_began_s']:.2f} s after the replacement's launcher started "
          f"(baseline {base['load_began_s']:.2f} s); first step {pre['first_step_s']:.2f} s after the kill "
          f"(baseline {base['first_step_s']:.2f} s); copies in the two runs {base['copy_s']:.2f} / {copy_s:.2f} s")
    # the prefetch hides at least part of the transfer that today's load waits for in full
    assert pre["wait_s"] / copy_s < base["wait_s"] / base["copy_s"], (pre, base)
    assert base["wait_s"] / base["copy_s"] > 0.5, base  # today's load waits for (most of) the copy


def _scenario(cluster: Cluster, tmp: Path, *, prefetch: bool) -> dict[str, Any]:
    h0, h1 = cluster.add_host(), cluster.add_host()
    for h in (h0, h1):
        h.shape(rate_mbit=RATE_MBIT)
    job = HostJob(cluster, tmp, train=["--steps", str(STEPS), "--step-time", "0.2", "--ballast-mib", str(BALLAST_MIB)],
                  run_args=["--replicas", "1", f"--agent-listen=0.0.0.0:{AGENT_PORT}"])
    job.start([h0, h1])
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= 10, 240, "both ranks reach step 10")
    job.wait_for(lambda: newest_replica(h0, f"{NS}--rank1") >= 5, 180, "host 0 holds a replica of rank 1's step 5+")
    t_kill = time.time()
    h1.kill()
    fault = job.wait_for(lambda: next((e for e in job.events(h0.name) if e["event"] == "fault"), None), 60,
                         "the survivor notices")
    assert_lost_host_blamed(job, h0, fault, t_kill, node=1)
    h2 = cluster.add_host()
    h2.shape(rate_mbit=RATE_MBIT)
    t_launch = time.time()
    job.start_node(h2, 1, **({} if prefetch else {"TIERCKPT_PREFETCH": "0"}))
    job.wait_for(lambda: any(e["event"] == "resumed" and e["generation"] >= 1 for e in job.trace(1)), 300,
                 "rank 1 resumes on the replacement")
    # while the job still trains: how long the load's fetch requests waited on the agent (the network)
    status = json.loads(h2.run([sys.executable, "-I", "-c", _STATUS], timeout=120).stdout)
    codes = job.wait_exit(300, [h0.name, h2.name])
    assert codes == {h0.name: 0, h2.name: 0}, job.report()

    gen, resumed = job.resumed_last(RANKS)
    step = resumed[0]["step"]
    assert resumed[1]["step"] == step >= 1 and "peer" in (resumed[1]["tiers"] or []), resumed
    for r in RANKS:  # bitwise: the digest covers every parameter and the ballast buffer
        saved = {e["step"]: e["digest"] for e in job.trace(r) if e["event"] == "step" and e["generation"] < gen}
        assert resumed[r]["digest"] == saved[step], f"rank {r}: resumed state differs from step {step}'s"
        assert job.last_step(r, generation=gen) == STEPS
    load_began = resumed[1]["time"] - resumed[1]["load_s"]
    events = job.events(h2.name)
    began = [e for e in events if e["event"] == "prefetch" and e.get("phase") == "started"]
    done = [e for e in events if e["event"] == "prefetch" and e.get("phase") == "done"]
    waits = status["load_waits"][f"{NS}--rank1/step_{step}"]
    out: dict[str, Any] = {"wait_s": float(waits["seconds"]), "load_s": float(resumed[1]["load_s"]),
                           "load_began_s": load_began - t_launch,
                           "first_step_s": min(e["time"] for e in job.trace(1) if e["event"] == "step"
                                               and e["generation"] == gen) - t_kill}
    if prefetch:
        assert began and done and done[0]["ok"], job.report()
        assert began[0]["time"] < load_began, (began, load_began)  # it began before the workers' load
        fetched = done[0]["fetched"]
        assert f"{NS}--rank1" in fetched and fetched[f"{NS}--rank1"]["step"] == step, (fetched, step)
        out.update(prefetch_lead_s=load_began - began[0]["time"], prefetch_s=float(done[0]["seconds"]),
                   bytes=int(done[0]["bytes"]))
    else:
        assert not began, began
        out["bytes"] = _fetched_bytes(h2, f"{NS}--rank1", step)
    out["copy_s"] = _socket_copy(h0, h2, out["bytes"])
    for h in (h0, h2):
        h.kill()
    print(f"\n{'prefetch' if prefetch else 'baseline'}: {out}", flush=True)
    return out


# the agent's status over its local socket, standard library only (importing torch for the
# CLI takes tens of seconds on this loaded 2-core box)
_STATUS = """
import socket
s = socket.socket(socket.AF_UNIX)
s.settimeout(60)
s.connect("/dev/shm/tierckpt/.agent.sock")
s.sendall(b'{"op": "status"}\\n')
buf = b""
while not buf.endswith(b"\\n"):
    chunk = s.recv(65536)
    if not chunk:
        break
    buf += chunk
print(buf.decode())
"""


def _socket_copy(src: Host, dst: Host, nbytes: int) -> float:
    """Seconds for ``nbytes`` from ``src`` to ``dst`` over a plain TCP connection (the same capped link)."""
    import subprocess

    recv = dst.popen([sys.executable, str(SOCKCOPY), "recv", "7700", str(nbytes)], stdout=subprocess.PIPE, text=True)
    assert recv.stdout is not None and recv.stdout.readline().strip() == "listening"
    sent = src.run([sys.executable, str(SOCKCOPY), "send", dst.ip, "7700", str(nbytes)], timeout=120)
    recv.wait(30)
    recv.stdout.close()
    return float(json.loads(sent.stdout.strip().splitlines()[-1])["seconds"])



def _fetched_bytes(host: Host, ns: str, step: int) -> int:
    """Bytes of the files ``host``'s agent fetched from peers for ``step`` (data files, ``.metadata``)."""
    out = host.run(["sh", "-c", f"stat -c '%n %s' /dev/shm/tierckpt/.peer/{ns}/step_{step}/*"]).stdout
    return sum(int(size) for name, size in (line.rsplit(" ", 1) for line in out.splitlines())
               if name.endswith((".distcp", ".metadata")))
