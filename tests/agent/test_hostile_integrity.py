"""Issue 16, integrity (items 6-12): nothing a peer sends makes the agent keep or serve bad bytes,
write or read outside its memory root, or overrun its budget.

Each attack speaks the wire protocol by hand (``tests.agent.hostile``), then checks that the
agent still serves a legitimate peer bit-for-bit and that nothing outside the root changed."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

import tierckpt
from tests.agent.conftest import wait_for
from tests.agent.hostile import (
    NS,
    SECRET,
    client_handshake,
    get,
    payload,
    put,
    serve_hello,
    serves_bit_for_bit,
    start_child,
    tree_digest,
)
from tests.agent.test_agent import _save
from tierckpt import layout
from tierckpt.agent import protocol as p
from tierckpt.agent.config import AgentLimits
from tierckpt.agent.store import NodeStore
from tierckpt.errors import IntegrityError
from tierckpt.tiers.integrity import verify_copy
from tierckpt.tiers.peer import local_request


def _save_big(memory_dir: str, step: int, mib: int) -> None:
    with tierckpt.Checkpointer(tierckpt.CheckpointConfig(namespace=NS, memory_dir=memory_dir)) as ck:
        ck.save(step, {"w": torch.randn(mib << 18, generator=torch.Generator().manual_seed(step))})
        ck.wait()


def _replicas(memory_dir: str, origin: str = "node-a") -> list[int]:
    return [s.step for s in NodeStore(memory_dir, "x").replica(origin, NS).list_steps()]


def test_concurrent_puts_of_one_step_commit_one_good_copy(node_dir, agent) -> None:
    """Item 6: one staging directory per connection, one rename; a second put is refused."""
    a_dir, b_dir = node_dir("a"), node_dir("b")
    _save(a_dir, [1])
    files = payload(a_dir, 1)
    b = agent(memory_dir=b_dir, node_id="node-b", secret=SECRET, replicas=0)
    first = client_handshake(b.address, "node-a")
    assert put(first, "node-a", 1, files, send=False)["op"] == "ready"
    for _, data in files[:-1]:
        first.send_bytes(data)
    second = client_handshake(b.address, "node-a")
    refused = put(second, "node-a", 1, files)
    assert refused["op"] == "error" and "in flight" in refused["message"]
    first.send_bytes(files[-1][1])
    assert first.recv()["op"] == "stored"
    assert put(second, "node-a", 1, files)["op"] == "held"  # committed already: nothing to send
    other_owner = put(second, "node-a", 1, files, owner="cd" * 32)
    assert other_owner["op"] == "error" and "another sender" in other_owner["message"]
    first.close()
    second.close()
    assert _replicas(b_dir) == [1]
    assert verify_copy(NodeStore(b_dir, "node-b").replica("node-a", NS), 1, NS).ok
    serves_bit_for_bit(b.address, b_dir, "node-a", 1, replica=True)


def test_the_holder_verifies_a_replica_before_serving_it_and_quarantines_a_bad_one(node_dir, agent) -> None:
    """Item 7: a flipped byte on the holder is refused there, and the copy is taken out of service."""
    a_dir, b_dir = node_dir("a"), node_dir("b")
    _save(a_dir, [1, 2], memory_steps_retained=2)
    b = agent(memory_dir=b_dir, node_id="node-b", secret=SECRET, replicas=0)
    conn = client_handshake(b.address, "node-a")
    assert put(conn, "node-a", 1, payload(a_dir, 1), keep=(1, 2))["op"] == "stored"
    assert put(conn, "node-a", 2, payload(a_dir, 2), keep=(1, 2))["op"] == "stored"
    conn.close()
    data = Path(b_dir, layout.REPLICAS, "node-a", NS, "step_1", "__0_0.distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    meta = Path(b_dir, layout.REPLICAS, "node-a", NS, "step_2", layout.METADATA)
    meta.write_bytes(meta.read_bytes()[:-1] + b"\0")
    peer = client_handshake(b.address, "node-legit")
    with pytest.raises(IntegrityError, match="checksum"):  # said instead of the bad segment
        get(peer, "node-a", 1, "__0_0.distcp")
    peer.send({"op": "get", "ns": NS, "origin": "node-a", "step": 2, "name": layout.METADATA})
    reply = peer.recv()
    assert reply["op"] == "error" and "checksum" in reply["message"]
    peer.close()
    assert _replicas(b_dir) == []  # both quarantined: offered to nobody
    assert len(list(Path(b_dir, layout.REPLICAS, "node-a", NS, ".quarantine").iterdir())) == 2
    assert b._agent.metrics.replicas_rejected.value() == 2


def test_symlinks_in_the_memory_root_are_never_followed(node_dir, agent, tmp_path) -> None:
    """Item 8: links planted as a file, a step directory, ``.replicas/<origin>`` and ``.pins``."""
    a_dir, b_dir = node_dir("a"), node_dir("b")
    _save(a_dir, [1])
    _save(b_dir, [1, 2, 3], memory_steps_retained=3)
    outside = tmp_path / "outside"
    shutil.copytree(Path(b_dir, NS, "step_3"), outside / "step_3")
    (outside / "node-a").mkdir()
    shutil.rmtree(Path(b_dir, NS, "step_3"))
    os.symlink(outside / "step_3", Path(b_dir, NS, "step_3"))  # a whole step directory
    target = Path(b_dir, NS, "step_2", "__0_0.distcp")
    shutil.copy(target, outside / "secret.distcp")
    target.unlink()
    os.symlink(outside / "secret.distcp", target)  # one data file
    os.symlink(outside / "node-a", Path(b_dir, layout.REPLICAS))  # .replicas itself → outside
    os.symlink(outside, Path(b_dir, NS, layout.PINS))  # where pins would be linked
    before = tree_digest(outside)
    b = agent(memory_dir=b_dir, node_id="node-b", secret=SECRET, replicas=0)
    conn = client_handshake(b.address, "node-legit")
    conn.send({"op": "list", "ns": NS})
    assert sorted(e["step"] for e in conn.recv()["steps"]) == [1]  # step 2 (a link inside) and 3 hidden
    for step in (2, 3):
        conn.send({"op": "get", "ns": NS, "origin": "node-b", "step": step, "name": "__0_0.distcp"})
        assert conn.recv()["op"] == "error"
    assert get(conn, "node-b", 1, "__0_0.distcp") == Path(b_dir, NS, "step_1", "__0_0.distcp").read_bytes()
    conn.close()
    sender = client_handshake(b.address, "node-a")
    reply = put(sender, "node-a", 1, payload(a_dir, 1))
    assert reply["op"] == "error" and "stage" in reply["message"]
    sender.close()
    serves_bit_for_bit(b.address, b_dir, "node-b", 1)
    assert tree_digest(outside) == before  # nothing written, linked or removed out there


def test_get_of_an_unknown_namespace_changes_nothing_and_pins_are_bounded(node_dir, agent) -> None:
    """Item 9: no directories from failed gets; a reader that stalls loses its pin at the deadline."""
    d = node_dir("a")
    _save_big(d, 1, 64)
    a = agent(memory_dir=d, node_id="node-a", secret=SECRET, replicas=0,
              limits=AgentLimits(request_s=1.0, min_rate_bps=16e6))
    a.tick()  # the agent's first round writes <ns>/.keep: the digest is taken after it, not racing it
    before = tree_digest(Path(d))
    conn = client_handshake(a.address, "node-x")
    for i in range(50):
        conn.send({"op": "get", "ns": f"nope-{i}", "origin": "node-a", "step": 1, "name": "__0_0.distcp"})
        assert conn.recv()["op"] == "error"
    assert tree_digest(Path(d)) == before
    conn.send({"op": "get", "ns": NS, "origin": "node-a", "step": 1, "name": "__0_0.distcp"})
    assert conn.recv()["op"] == "file"  # ... and the reader stops reading
    pins = Path(d, NS, layout.PINS)
    wait_for(lambda: pins.exists() and any(pins.iterdir()), "the pin while the file is sent", 5)
    t0 = time.monotonic()
    wait_for(lambda: not any(pins.iterdir()), "the pin to go at the request's deadline", 15)
    assert time.monotonic() - t0 < 10
    conn.close()
    serves_bit_for_bit(a.address, d, "node-a", 1)


class _FakePeer:
    """A 'peer agent' that authenticates properly, then answers every list with ``steps``."""

    def __init__(self, steps: list[object]) -> None:
        from tierckpt.agent.wire import Connection

        self.steps = steps
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.address = self.sock.getsockname()
        self._conn_cls = Connection
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import secrets

        while True:
            try:
                s, _ = self.sock.accept()
            except OSError:
                return
            conn = self._conn_cls(s, step_timeout=5)
            try:
                nonce = secrets.token_hex(32)
                binding = serve_hello(conn, "node-f", nonce)
                auth = conn.recv()
                ids = (nonce, auth["nonce"], "node-f", auth["node"], binding)
                conn.send({"op": "welcome", "node": "node-f", "mac": p.server_mac(SECRET, *ids)})
                conn.recv()
                conn.recv()
                conn.send({"op": "listing", "steps": self.steps, "more": False})
            except (OSError, p.ProtocolViolation):  # ssl.SSLError is an OSError
                pass
            finally:
                conn.close()

    def close(self) -> None:
        self.sock.close()


def test_listing_fields_from_peers_are_validated_entry_by_entry(node_dir, agent) -> None:
    """Item 10: bad steps, sizes, save ids and names are dropped; the good entries stay."""
    good = {"step": 4, "origin": "node-f", "save_id": "s1", "held": {"__0_0.distcp": 10}, "all": ["__0_0.distcp"]}
    bad = [{**good, "step": "4"}, {**good, "step": -1}, {**good, "save_id": "../x"},
           {**good, "held": {"../../etc/passwd": 1}}, {**good, "held": {"__0_0.distcp": -5}},
           {**good, "all": ["/etc/shadow"]}, {**good, "origin": "a/b"}, "not an entry", {**good, "step": 2**70}]
    fake = _FakePeer([*bad, good, {**good, "step": 5, "origin": "node-g"}])
    try:
        d = node_dir("a")
        agent(memory_dir=d, node_id="node-a", secret=SECRET, replicas=0, peers=(fake.address,))
        reply = local_request(d, {"op": "catalog", "ns": NS}, timeout=30)
        assert reply["ok"] and [(s["step"], s["held"]) for s in reply["steps"]] == [
            (4, {"__0_0.distcp": 10}), (5, {"__0_0.distcp": 10})]
    finally:
        fake.close()


def test_the_budget_reserves_before_bytes_and_evicts_only_when_they_are_here(node_dir, agent) -> None:
    """Item 11: two 4 MiB puts into 6 MiB: one is refused; a held replica survives a put that stalls."""
    a_dir, b_dir = node_dir("a"), node_dir("b")
    _save_big(a_dir, 1, 4)
    files = payload(a_dir, 1)
    size = sum(len(b) for _, b in files)
    base = NodeStore(b_dir, "node-b").usage_bytes()
    b = agent(memory_dir=b_dir, node_id="node-b", secret=SECRET, replicas=0, budget_bytes=base + (6 << 20))
    conn = client_handshake(b.address, "node-a")
    assert put(conn, "node-a", 1, files, keep=(1, 2, 3))["op"] == "stored"  # the replica held
    stalled = client_handshake(b.address, "node-a")
    stalled.send({"op": "put", "ns": NS, "origin": "node-a", "step": 2, "save_id": "s2", "owner": "ab" * 32,
                  "files": [["__0_0.distcp", size], [".metadata", 1], ["manifest.json", 1], ["COMMITTED", 1]]})
    assert stalled.recv()["op"] == "ready"  # room, once the older replica goes: but not before
    stalled.send_bytes(b"\0" * (1 << 20))
    time.sleep(0.3)
    assert _replicas(b_dir) == [1]
    third = client_handshake(b.address, "node-a")
    third.send({"op": "put", "ns": NS, "origin": "node-a", "step": 3, "save_id": "s3", "owner": "ab" * 32,
                "files": [["__0_0.distcp", size], [".metadata", 1], ["manifest.json", 1], ["COMMITTED", 1]]})
    refused = third.recv()
    assert refused["op"] == "error" and "node budget" in refused["message"]
    stalled.close()
    third.close()
    conn.close()
    wait_for(lambda: b._agent.state.reserved_bytes() == 0, "the stalled put's reservation to be released")
    assert _replicas(b_dir) == [1] and verify_copy(NodeStore(b_dir, "node-b").replica("node-a", NS), 1, NS).ok
    assert NodeStore(b_dir, "node-b").usage_bytes() <= base + (6 << 20)
    serves_bit_for_bit(b.address, b_dir, "node-a", 1, replica=True)


@pytest.mark.slow  # agents in subprocesses (each start imports torch)
def test_a_write_error_is_answered_with_an_error_frame(node_dir) -> None:
    """Item 12: EFBIG (RLIMIT_FSIZE) while storing a replica: the sender is told what failed."""
    a_dir, b_dir = node_dir("a"), node_dir("b")
    _save_big(a_dir, 1, 4)
    _save(b_dir, [1])
    child = start_child(b_dir, "node-b", rlimits={"RLIMIT_FSIZE": 1 << 20})
    try:
        conn = client_handshake(child.address, "node-a")
        reply = put(conn, "node-a", 1, payload(a_dir, 1))
        assert reply["op"] == "error" and "EFBIG" in reply["message"] and "__0_0.distcp" in reply["message"]
        conn.close()
        assert _replicas(b_dir) == []
        assert not any(Path(b_dir, layout.REPLICAS, "node-a", NS, layout.STAGING).iterdir())
        serves_bit_for_bit(child.address, b_dir, "node-b", 1)
    finally:
        child.stop()
