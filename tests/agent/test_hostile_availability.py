"""Issue 16, availability (items 1-5): nothing a peer sends stops the agent or fills it.

Each attack speaks the wire protocol by hand, then checks that the agent is alive, serves a
legitimate peer bit-for-bit, and is back to its baseline descriptors, threads and RSS."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from tests.agent.hostile import (
    NS,
    back_to_baseline,
    client_handshake,
    closed_by_server,
    proc_stats,
    serves_bit_for_bit,
    start_child,
    tree_digest,
)
from tests.agent.test_agent import SECRET, _save
from tierckpt import layout
from tierckpt.agent import protocol as p
from tierckpt.agent.config import AgentLimits
from tierckpt.tiers.peer import local_request


def _hold_connections(address: tuple[str, int], n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    out = []
    for _ in range(n):
        try:
            out.append(socket.create_connection(address, timeout=5, source_address=(source, 0)))
        except OSError:
            break
    return out


@pytest.mark.slow  # agents in subprocesses (each start imports torch)
def test_listener_survives_emfile_and_threads_that_cannot_start(node_dir, tmp_path) -> None:
    """Item 1: descriptors run out (EMFILE), then threads cannot start: the listener lives on."""
    d = node_dir("a")
    _save(d, [1])
    outside = tree_digest(tmp_path)
    for limit in ({"RLIMIT_NOFILE": 12}, {"RLIMIT_AS": 48 << 20}):
        child = start_child(d, "node-a", rlimits=limit)
        try:
            base = proc_stats(child.pid)
            held = _hold_connections(child.address, 60)
            time.sleep(1.0)  # the agent meets EMFILE / "can't start new thread" meanwhile
            assert child.proc.poll() is None
            for s in held:
                s.close()
            time.sleep(0.5)
            serves_bit_for_bit(child.address, d, "node-a", 1)  # accepting again
            back_to_baseline(child.pid, base)
        finally:
            child.stop()
    assert tree_digest(tmp_path) == outside


@pytest.mark.slow  # agents in subprocesses (each start imports torch)
def test_connections_are_capped_and_trickling_peers_meet_deadlines(node_dir) -> None:
    """Item 2: per-address and total caps; a byte every so often does not keep a connection;
    announced lengths (frames, 64 MiB .metadata) pin no memory."""
    d = node_dir("a")
    _save(d, [1])
    limits = {"max_per_address": 8, "max_connections": 20, "handshake_s": 2.0, "request_s": 2.0, "idle_s": 3.0}
    child = start_child(d, "node-a", limits=limits)
    try:
        base = proc_stats(child.pid)
        trickle = _hold_connections(child.address, 8)
        extra = socket.create_connection(child.address, timeout=5)
        assert closed_by_server(extra, 3)  # the ninth from one address is closed on accept
        serves_bit_for_bit(child.address, d, "node-a", 1, source="127.0.0.2")  # another address is served
        t0 = time.monotonic()
        for _ in range(4):  # one byte a second: the handshake deadline still ends them
            for s in trickle:
                try:
                    s.send(b"T")
                except OSError:
                    pass
            time.sleep(1.0)
        assert all(closed_by_server(s, 3) for s in trickle) and time.monotonic() - t0 < 10
        conns = [client_handshake(child.address, "node-x", source="127.0.0.3") for _ in range(4)]
        for c in conns:  # announced but never sent: a 1 MiB frame, then 64 MiB .metadata puts
            c.sock.sendall(p.HEADER.pack(p.MAGIC, p.MAX_BODY) + b"{")
        time.sleep(0.5)
        assert proc_stats(child.pid)["rss"] < base["rss"] + (16 << 20)
        for c in conns:
            assert closed_by_server(c.sock, 5)  # the request deadline
        conns = [client_handshake(child.address, "node-x", source="127.0.0.3") for _ in range(4)]
        for i, c in enumerate(conns):
            c.send({"op": "put", "ns": NS, "origin": "node-x", "step": i, "save_id": "s", "owner": "ab" * 32,
                    "files": [[".metadata", 64 << 20], ["manifest.json", 10], ["COMMITTED", 10]]})
            answer = c.recv()
            assert answer["op"] == "ready", answer
            c.sock.sendall(b"x" * 1000)
        time.sleep(0.5)
        assert proc_stats(child.pid)["rss"] < base["rss"] + (32 << 20)  # not +256 MiB
        for c in conns:
            c.close()
        serves_bit_for_bit(child.address, d, "node-a", 1)
        back_to_baseline(child.pid, base)
    finally:
        child.stop()


def _stuck_listener() -> socket.socket:
    """A 'peer' that accepts and never says a word."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


def test_a_stuck_peer_delays_only_itself(node_dir, agent) -> None:
    """Item 3: peers are asked at once with deadlines; a catalog does not wait on a stuck peer,
    and replication to the good peer goes on."""
    a_dir, b_dir = node_dir("a"), node_dir("b")
    stuck = _stuck_listener()
    try:
        b = agent(memory_dir=b_dir, node_id="node-b", secret=SECRET)
        _save(b_dir, [3])
        a = agent(memory_dir=a_dir, node_id="node-a", secret=SECRET, limits=AgentLimits(peer_deadline_s=2.0),
                  peers=(stuck.getsockname(), b.address))
        t0 = time.monotonic()
        reply = local_request(a_dir, {"op": "catalog", "ns": NS}, timeout=60)
        assert time.monotonic() - t0 < 6 and reply["ok"]
        assert [s["step"] for s in reply["steps"]] == [3]  # the good peer's step
        _save(a_dir, [5])
        from tests.agent.conftest import wait_for

        wait_for(lambda: Path(b_dir, layout.REPLICAS, "node-a", NS, "step_5", layout.MARKER).exists(),
                 "replication to node-b despite the stuck peer", timeout=20)
        assert a.status()["peers"] == {f"{b.address[0]}:{b.address[1]}": "node-b"}
    finally:
        stuck.close()


def test_deep_json_is_a_protocol_error_and_idle_local_clients_are_closed(node_dir, agent) -> None:
    """Item 4: nesting → an error frame (peer) or reply (local), never a RecursionError; a silent
    local client is closed."""
    d = node_dir("a")
    _save(d, [1])
    a = agent(memory_dir=d, node_id="node-a", secret=SECRET, replicas=0, limits=AgentLimits(local_idle_s=1.0))
    conn = client_handshake(a.address, "node-x")
    body = b"[" * 200_000 + b"]" * 200_000
    frame = p.HEADER.pack(p.MAGIC, len(body)) + body
    conn.sock.sendall(frame)
    reply = conn.recv()
    assert reply["op"] == "error" and "nests" in reply["message"]
    assert closed_by_server(conn.sock)
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(Path(d, layout.AGENT_SOCKET)))
    s.sendall(json.dumps({"op": "catalog", "ns": NS}).encode()[:-1] + b", \"x\": " + b"[" * 30000 + b"]" * 30000
              + b"}\n")
    answer = json.loads(s.makefile().readline())
    assert answer["ok"] is False and "nests" in answer["error"]
    s.close()
    idle = socket.socket(socket.AF_UNIX)
    idle.connect(str(Path(d, layout.AGENT_SOCKET)))
    t0 = time.monotonic()
    assert closed_by_server(idle, 10) and time.monotonic() - t0 < 5
    serves_bit_for_bit(a.address, d, "node-a", 1)


def test_a_listing_of_many_names_is_streamed(node_dir, agent) -> None:
    """Item 5: a sealed manifest of 60 000 names still lists (in several frames)."""
    d = node_dir("a")
    _save(d, [1])
    step_dir = Path(d, NS, "step_1")
    mf = layout.Manifest.from_bytes((step_dir / layout.MANIFEST).read_bytes())
    names = {f"__{i}_0.distcp": 1 for i in range(60_000)}
    big = layout.Manifest(NS, 1, mf.save_id, 60_000, mf.metadata_xxh3, {**names, **mf.files}, mf.items)
    raw = big.to_bytes()
    (step_dir / layout.MANIFEST).write_bytes(raw)
    (step_dir / layout.MARKER).write_bytes(layout.marker_bytes(mf.save_id, raw))
    a = agent(memory_dir=d, node_id="node-a", secret=SECRET, replicas=0)
    from tierckpt.agent.client import PeerClient

    client = PeerClient.connect(a.address, "node-x", SECRET)
    try:
        entries, bad = client.list_entries(NS)
    finally:
        client.close()
    assert bad == 0 and len(entries) == 1 and len(entries[0].all_files) == len(set(mf.files) | set(names))
    serves_bit_for_bit(a.address, d, "node-a", 1)
