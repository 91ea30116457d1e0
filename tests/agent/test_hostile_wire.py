"""Issue 27, item 4: defects of the peer wire found by attacking it.

A MAC that is not ASCII, an agent without a secret, a request frame that trickles in, a
deadline that ends a connection, a corrupted replica fetched by a requester: each is a typed
answer (an error frame, ``PeerError``, ``IntegrityError``), never a dead thread or a lie about
what went wrong."""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.agent.conftest import wait_for
from tests.agent.hostile import (
    NS,
    SECRET,
    back_to_baseline,
    client_handshake,
    client_hello,
    closed_by_server,
    payload,
    proc_stats,
    put,
    raw_accept,
    raw_connect,
    serve_hello,
    serves_bit_for_bit,
)
from tests.agent.test_agent import _save
from tierckpt import layout
from tierckpt.agent import protocol as p
from tierckpt.agent.client import PeerClient, PeerError
from tierckpt.agent.config import AgentLimits
from tierckpt.errors import IntegrityError

NOT_ASCII = "\u00e9" * 64


def test_a_mac_that_is_not_ascii_is_refused_on_both_sides(node_dir, agent) -> None:
    """The server answers an error frame and counts the connection; a client whose peer sends such a
    welcome gets PeerError (so a fetch goes on to the next holder), not a TypeError."""
    d = node_dir("a")
    _save(d, [1])
    a = agent(memory_dir=d, node_id="node-a", secret=SECRET, replicas=0)
    base = proc_stats(os.getpid())
    conn, hello, _ = client_hello(a.address)
    conn.send({"op": "auth", "node": "node-x", "nonce": secrets.token_hex(32)})
    assert conn.recv()["op"] == "welcome"
    conn.send({"op": "proof", "mac": NOT_ASCII})
    reply = conn.recv()
    assert reply["op"] == "error" and "authentication" in reply["message"], reply
    assert hello["op"] == "hello"
    conn.close()
    wait_for(lambda: a._agent.metrics.rejected.value() == 1, "the rejected connection counted")

    impostor = socket.socket()
    impostor.bind(("127.0.0.1", 0))
    impostor.listen(1)

    def fake_server() -> None:
        c = raw_accept(impostor)
        try:
            serve_hello(c, "node-f", "ab" * 32)
            c.recv()
            c.send({"op": "welcome", "node": "node-f", "mac": NOT_ASCII})
            c.recv()
        except (p.ProtocolViolation, OSError):
            pass
        finally:
            c.close()

    t = threading.Thread(target=fake_server, daemon=True)
    t.start()
    with pytest.raises(PeerError, match="authentication"):
        PeerClient.connect(impostor.getsockname(), "node-legit", SECRET, timeout=5)
    t.join(10)
    impostor.close()
    serves_bit_for_bit(a.address, d, "node-a", 1)
    back_to_baseline(os.getpid(), base)


def test_an_agent_without_a_secret_serves_no_peer(node_dir, agent) -> None:
    """On loopback without a job secret, a peer using the empty key is refused with an error frame
    (other local users are untrusted); a client without a secret does not even connect."""
    d = node_dir("a")
    _save(d, [1])
    a = agent(memory_dir=d, node_id="node-a", secret=None, replicas=0)
    conn = raw_connect(a.address)
    first = conn.recv()
    assert first["op"] == "error" and "secret" in first["message"], first
    assert closed_by_server(conn.sock)
    wait_for(lambda: a._agent.metrics.rejected.value() == 1, "the refused connection counted")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    with pytest.raises(PeerError, match="secret"):
        PeerClient.connect(listener.getsockname(), "node-x", None, timeout=2)
    with pytest.raises(TimeoutError):
        listener.accept()  # it never connected
    listener.close()


def test_a_request_frame_meets_the_request_deadline_and_a_deadline_says_so(node_dir, agent) -> None:
    """A request frame that trickles in is cut at ``request_s`` (not the idle deadline), and the
    connection ends with an error frame naming the deadline; so does an idle one."""
    d = node_dir("a")
    _save(d, [1])
    limits = AgentLimits(handshake_s=5.0, request_s=0.5, idle_s=4.0)
    a = agent(memory_dir=d, node_id="node-a", secret=SECRET, replicas=0, limits=limits)
    conn = client_handshake(a.address, "node-x")
    t0 = time.monotonic()
    conn.sock.sendall(p.encode({"op": "list", "ns": NS})[:3])  # the start of a frame, then nothing
    reply = conn.recv()
    assert reply["op"] == "error" and "deadline" in reply["message"], reply
    assert time.monotonic() - t0 < 3.0  # well before the idle deadline
    conn.close()
    conn = client_handshake(a.address, "node-x")
    t0 = time.monotonic()
    reply = conn.recv()  # says nothing at all
    assert reply["op"] == "error" and "idle" in reply["message"], reply
    assert time.monotonic() - t0 >= 3.5
    conn.close()
    serves_bit_for_bit(a.address, d, "node-a", 1)


def test_a_corrupted_replica_is_an_integrity_error_for_the_requester(node_dir, agent, tmp_path: Path) -> None:
    """The holder finds a flipped byte while sending: the requester gets IntegrityError (so the load
    says 'integrity', not 'storage'), and the connection is still in step for the next request."""
    a_dir, b_dir = node_dir("a"), node_dir("b")
    _save(a_dir, [1])
    b = agent(memory_dir=b_dir, node_id="node-b", secret=SECRET, replicas=0)
    conn = client_handshake(b.address, "node-a")
    assert put(conn, "node-a", 1, payload(a_dir, 1), keep=(1,))["op"] == "stored"
    conn.close()
    data = Path(b_dir, layout.REPLICAS, "node-a", NS, "step_1", "__0_0.distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    client = PeerClient.connect(b.address, "node-legit", SECRET, timeout=10)
    try:
        with pytest.raises(IntegrityError, match="checksum"):
            client.get_into(NS, "node-a", 1, "__0_0.distcp", tmp_path / "got")
        assert client.call({"op": "status"})["op"] == "status"  # still in step
    finally:
        client.close()
    assert b._agent.metrics.replicas_rejected.value() == 1
    assert not data.exists()  # quarantined: offered to nobody
