"""The key scenario, in real processes: three nodes (an agent process and one gloo worker
each, no durable tier) save; one node is lost (its agent SIGKILLed, its memory root wiped)
and comes back empty with a fresh agent; the job resumes from the newest step, the new
node's shards coming from a replica, bitwise equal. The same with k=2 and two nodes lost.
Also: an agent killed in the middle of receiving a replica leaves nothing that counts."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import tierckpt
from tests.agent.conftest import wait_for
from tests.helpers.dist import run_ranks
from tests.helpers.state import assert_state_equal, from_wire, small_state, to_wire, zeros_like_state
from tierckpt import layout
from tierckpt.agent.client import PeerClient
from tierckpt.agent.store import NodeStore
from tierckpt.tiers.peer import local_request

pytestmark = pytest.mark.slow

NS = "lost-node"
SECRET = "scenario-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_agent(memory_dir: str, node_id: str, port: int, peers: list[int], replicas: int = 1) -> subprocess.Popen:
    env = {**os.environ, "TIERCKPT_AGENT_SECRET": SECRET}
    cmd = [sys.executable, "-m", "tierckpt.agent", "serve", "--memory-dir", memory_dir, "--node-id", node_id,
           "--listen", f"127.0.0.1:{port}", "--peers", ",".join(f"127.0.0.1:{p}" for p in peers),
           "--replicas", str(replicas), "--scan-interval", "0.2"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def _ready(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "listening on HOST:PORT node ID" once serving
    assert line.startswith("listening on "), line


def _save(rank: int, dirs: list[str], steps: list[int]) -> None:
    cfg = tierckpt.CheckpointConfig(namespace=NS, memory_dir=dirs[rank])
    with tierckpt.Checkpointer(cfg) as ck:
        for step in steps:
            ck.save(step, small_state(step, rank))
        ck.wait()


def _load(rank: int, dirs: list[str]) -> dict:
    sd = zeros_like_state(small_state(0, rank))
    with tierckpt.Checkpointer(tierckpt.CheckpointConfig(namespace=NS, memory_dir=dirs[rank])) as ck:
        step = ck.load(sd)
        return {"step": step, "tiers": ck.last_load["tiers"], "state": to_wire(sd)}


def _replicated(memory_dir: str, step: int, k: int) -> bool:
    try:
        info = local_request(memory_dir, {"op": "status"}, timeout=5)["namespaces"].get(NS, {})
    except tierckpt.StorageError:
        return False
    return bool(info.get("replicated", {}).get("step") == step and len(info["replicated"].get("to", [])) >= k)


@pytest.mark.parametrize(("k", "lost"), [(1, [2]), (2, [1, 2])], ids=["k1-one-lost", "k2-two-lost"])
def test_lost_nodes_resume_from_replicas(node_dir, k: int, lost: list[int]) -> None:
    dirs = [node_dir(f"n{i}") for i in range(3)]
    ports = [_free_port() for _ in range(3)]
    ids = [f"node-{i}" for i in range(3)]
    procs = [_start_agent(d, n, port, [q for q in ports if q != port], replicas=k)
             for d, n, port in zip(dirs, ids, ports, strict=True)]
    try:
        for proc in procs:
            _ready(proc)
        run_ranks(_save, 3, dirs, [1, 2, 3], timeout=120)
        for d in dirs:
            wait_for(lambda d=d: _replicated(d, 3, k), f"step 3 of {d} replicated to {k} nodes")
        for n in lost:  # the node is lost: its agent (SIGKILL) and its memory
            _stop(procs[n])
            shutil.rmtree(dirs[n])
            os.mkdir(dirs[n])
        for n in lost:  # replaced by fresh nodes with the same identities
            procs[n] = _start_agent(dirs[n], ids[n], ports[n], [q for q in ports if q != ports[n]], replicas=k)
            _ready(procs[n])
        results = run_ranks(_load, 3, dirs, timeout=120)
        for rank, out in enumerate(results):
            assert out["step"] == 3, out["step"]
            assert_state_equal(from_wire(out["state"]), small_state(3, rank))
        for n in lost:
            assert "peer" in results[n]["tiers"] and "memory" not in results[n]["tiers"], results[n]["tiers"]
        # the only surviving copies of the lost nodes' shards are the replicas node 0 holds
        # (k=1: the ring 2 → 0; k=2: node 0 holds both other nodes' steps)
        for n in lost:
            assert [s.step for s in NodeStore(dirs[0], ids[0]).replica(ids[n], NS).list_steps()][-1] == 3
    finally:
        for proc in procs:
            _stop(proc)


def test_agent_killed_mid_transfer_leaves_no_replica(node_dir) -> None:
    d = node_dir("recv")
    port = _free_port()
    proc = _start_agent(d, "node-r", port, [])
    try:
        _ready(proc)
        client = PeerClient.connect(("127.0.0.1", port), "node-s", SECRET.encode())
        assert client.call({"op": "put", "ns": NS, "origin": "node-s", "step": 5, "save_id": "abc",
                            "files": [["__0_0.distcp", 64 << 20], [".metadata", 1], ["manifest.json", 1],
                                      ["COMMITTED", 1]], "owner": "ab" * 32})["op"] == "ready"
        client.send_bytes(b"\0" * (8 << 20))
        staging = Path(d, layout.REPLICAS, "node-s", NS, layout.STAGING)
        wait_for(lambda: any(staging.glob("*/__0_0.distcp")), "the transfer to be under way")
        proc.send_signal(signal.SIGKILL)
        _stop(proc)
        client.close()
        assert NodeStore(d, "node-r").replica("node-s", NS).list_steps() == []  # a partial copy never counts
        proc = _start_agent(d, "node-r", port, [])
        _ready(proc)
        assert not any(staging.glob("*")), "the restarted agent removes the dead transfer"
        assert NodeStore(d, "node-r").replica("node-s", NS).list_steps(include_uncommitted=True) == []
    finally:
        _stop(proc)
