"""Issue 27, item 4: defects of the peer wire found by attacking it.

A MAC that is not ASCII, an agent without a secret, a request frame that trickles in, a
deadline that ends a connection, a corrupted replica fetched by a requester: each is a typed
answer (an error frame, ``PeerError``, ``IntegrityError``), never a dead thread or a lie about
what went wrong."""

from __future__ import annotations

import os
import secrets
import socket
import stat
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
    payload,
    proc_stats,
    put,
    raw_accept,
    serve_hello,
    serves_bit_for_bit,
)
from tests.agent.test_agent import _save
from tierckpt import layout
from tierckpt.agent import protocol as p
from tierckpt.agent.client import PeerClient, PeerError
from tierckpt.agent.config import AgentLimits, user_secret
from tierckpt.errors import ConfigError, IntegrityError

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


def test_an_agent_without_a_secret_serves_only_this_users_agents(node_dir, agent, tmp_path: Path,
                                                                 monkeypatch) -> None:
    """On loopback without a job secret the agent does not serve the empty key (another local user):
    it authenticates with this user's own secret file (0600 in a 0700 directory), which this user's
    other agents share, so they still replicate; a client with no secret at all does not connect."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("TIERCKPT_AGENT_SECRET", raising=False)
    a_dir, b_dir = node_dir("a"), node_dir("b")
    b = agent(memory_dir=b_dir, node_id="node-b", secret=None, replicas=0)
    a = agent(memory_dir=a_dir, node_id="node-a", secret=None, peers=(b.address,))
    secret_file = tmp_path / ".config" / "tierckpt" / "agent-secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(secret_file.parent.stat().st_mode) == 0o700
    for key in (b"", SECRET):  # the empty key, or any key but this user's
        conn, hello, binding = client_hello(b.address)
        mine = secrets.token_hex(32)
        conn.send({"op": "auth", "node": "node-x", "nonce": mine})
        welcome = conn.recv()
        ids = (hello["nonce"], mine, hello["node"], "node-x", binding)
        with pytest.raises(p.ProtocolViolation, match="authentication"):
            p.check_mac(p.server_mac(key, *ids), welcome["mac"])  # the agent is not fooled either way
        conn.send({"op": "proof", "mac": p.client_mac(key, *ids)})
        reply = conn.recv()
        assert reply["op"] == "error" and "authentication" in reply["message"], reply
        conn.close()
    wait_for(lambda: b._agent.metrics.rejected.value() == 2, "both refused connections counted")
    _save(a_dir, [1])
    wait_for(lambda: Path(b_dir, layout.REPLICAS, "node-a", NS, "step_1", layout.MARKER).exists(),
             "this user's agents replicate with its own secret")
    assert secret_file.read_bytes().strip() == a._agent.secret == b._agent.secret
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    with pytest.raises(PeerError, match="secret"):
        PeerClient.connect(listener.getsockname(), "node-x", None, timeout=2)
    with pytest.raises(TimeoutError):
        listener.accept()  # it never connected
    listener.close()
    secret_file.chmod(0o644)
    with pytest.raises(ConfigError, match="0600"):
        user_secret(str(secret_file))


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
