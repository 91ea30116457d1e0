"""``tierckpt bench replication``: peer replication and restore against their anchors, same run.

    tierckpt bench replication [--size-mib 1024] [--rounds 3] [--json PATH]

Two agents on loopback (in this process), each with its own memory root under /dev/shm.
Paired rounds, back to back:
  replication   agent A sends a committed step of ``--size-mib`` to agent B (sendfile, B
                verifies every checksum and commits)  vs  a plain socket copy of the same
                bytes (sendfile → recv_into → write into a tmpfs file, no verification)
  restore       a node that lost its memory root loads its shards through its agent from
                B's replica (``Checkpointer.load``, verified)  vs  the same load from a
                filesystem durable tier (``file://`` under --durable-dir)
Goals (ARCHITECTURE.md section 7): replication ≥ 0.8 × the socket copy. Figures are medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

import tierckpt
from tierckpt.agent import AgentConfig, start_agent

__all__ = ["main"]

NS = "bench-replication"


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
        raise RuntimeError("the socket copy was short")
    return dt


def _state(nbytes: int) -> dict[str, torch.Tensor]:
    n = nbytes // 4 // 8
    return {f"t{i}": torch.randn(n) for i in range(8)}


def run(size_mib: int, rounds: int, workdir: Path) -> dict[str, Any]:
    a_dir, b_dir, lost_dir, copy_dir = (workdir / n for n in ("node-a", "node-b", "node-a-fresh", "copy"))
    for d in (a_dir, b_dir, lost_dir, copy_dir):
        d.mkdir()
    durable = tempfile.mkdtemp(prefix="tierckpt-bench-durable-", dir=os.environ.get("TMPDIR", "/tmp"))
    url = f"file://{durable}"
    sd = _state(size_mib << 20)
    cfg = tierckpt.CheckpointConfig(namespace=NS, memory_dir=str(a_dir), durable_url=url)
    with tierckpt.Checkpointer(cfg) as ck:
        ck.save(1, sd, durable=True)
        ck.wait()
    data = a_dir / NS / "step_1" / "__0_0.distcp"
    nbytes = sum(f.stat().st_size for f in (a_dir / NS / "step_1").iterdir())
    b = start_agent(AgentConfig(memory_dir=str(b_dir), node_id="bench-b", scan_interval_s=1e6))
    a = start_agent(AgentConfig(memory_dir=str(a_dir), node_id="bench-a", peers=(b.address,), scan_interval_s=1e6))
    fig: dict[str, list[float]] = {"replication_s": [], "socket_copy_s": [], "restore_peer_s": [], "restore_durable_s": []}
    try:
        agent = a._agent
        agent._refresh_peers()
        for _ in range(rounds):
            shutil.rmtree(b_dir / ".replicas", ignore_errors=True)
            agent.replicated.clear()
            t0 = time.perf_counter()
            agent._replicate_newest(NS)
            fig["replication_s"].append(time.perf_counter() - t0)
            if not (b_dir / ".replicas" / "bench-a" / NS / "step_1" / "COMMITTED").exists():
                raise RuntimeError("replication did not complete")
            fig["socket_copy_s"].append(_socket_copy(data, copy_dir / "copy"))
            (copy_dir / "copy").unlink()
        # restore: the lost node is a fresh root with its own agent, peers = B
        fresh = start_agent(AgentConfig(memory_dir=str(lost_dir), node_id="bench-a", peers=(b.address,),
                                        scan_interval_s=1e6, replicas=0))
        try:
            for _ in range(rounds):
                shutil.rmtree(lost_dir / ".peer", ignore_errors=True)
                target = {k: torch.empty_like(v) for k, v in sd.items()}
                fig["restore_peer_s"].append(_timed_load(str(lost_dir), None, target, "peer", sd))
                target = {k: torch.empty_like(v) for k, v in sd.items()}
                empty = workdir / f"empty-{len(fig['restore_durable_s'])}"
                empty.mkdir()
                fig["restore_durable_s"].append(_timed_load(str(empty), url, target, "durable", sd))
        finally:
            fresh.close()
    finally:
        a.close()
        b.close()
        shutil.rmtree(durable, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in fig.items()}
    return {
        "bytes": nbytes, "rounds": rounds, "raw": fig, "median_s": med,
        "replication_MBps": nbytes / 1e6 / med["replication_s"],
        "socket_copy_MBps": nbytes / 1e6 / med["socket_copy_s"],
        "replication_vs_socket": med["socket_copy_s"] / med["replication_s"],
        "restore_peer_vs_durable_fs": med["restore_durable_s"] / med["restore_peer_s"],
    }


def _timed_load(memory_dir: str, url: str | None, target: dict[str, torch.Tensor], tier: str,
                expect: dict[str, torch.Tensor]) -> float:
    cfg = tierckpt.CheckpointConfig(namespace=NS, memory_dir=memory_dir, durable_url=url)
    t0 = time.perf_counter()
    with tierckpt.Checkpointer(cfg) as ck:
        step = ck.load(target)
        tiers = ck.last_load["tiers"]
    dt = time.perf_counter() - t0
    if step != 1 or tiers != [tier] or not all(torch.equal(target[k], expect[k]) for k in expect):
        raise RuntimeError(f"restore from {tier} gave step {step} from {tiers}, or different bytes")
    return dt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tierckpt bench replication", description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="tierckpt-bench-repl-", dir="/dev/shm"))
    try:
        out = run(args.size_mib, args.rounds, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    m = out["median_s"]
    mb = out["bytes"] / 1e6
    print(f"step of {mb:.0f} MB, median of {out['rounds']} paired rounds")
    print(f"replication to a peer agent   {m['replication_s']:.3f}s  {out['replication_MBps']:.0f} MB/s (verified, committed)")
    print(f"plain socket copy             {m['socket_copy_s']:.3f}s  {out['socket_copy_MBps']:.0f} MB/s")
    verdict = "PASS" if out["replication_vs_socket"] >= 0.8 else "MISS"
    print(f"  replication / socket copy = {out['replication_vs_socket']:.2f} x  (goal >= 0.8: {verdict})")
    print(f"restore from a peer replica   {m['restore_peer_s']:.3f}s")
    print(f"restore from durable file://  {m['restore_durable_s']:.3f}s")
    print(f"  peer is {out['restore_peer_vs_durable_fs']:.2f} x faster than the filesystem durable tier")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
