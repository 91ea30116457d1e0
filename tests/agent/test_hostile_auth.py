"""Issue 16, authentication (items 13-16), on the TLS wire of issue 27: identities and the server's
certificate bound into the MACs, every byte under TLS, no downgrade, no unauthenticated listening
beyond loopback, everything private from creation.

The attacks speak the wire protocol by hand (``tests.agent.hostile``); an on-path attacker is a
relay in the middle that rewrites one byte, replays a TLS record, strips TLS from the hello, or
terminates TLS on both sides with a certificate of its own."""

from __future__ import annotations

import argparse
import os
import secrets
import select
import socket
import ssl
import stat
import threading
import time
from pathlib import Path

import pytest

from tests.agent.conftest import lose_namespace, wait_for
from tests.agent.hostile import (
    NS,
    SECRET,
    back_to_baseline,
    client_handshake,
    client_hello,
    closed_by_server,
    get,
    payload,
    proc_stats,
    put,
    raw_accept,
    serve_hello,
    serves_bit_for_bit,
)
from tests.agent.test_agent import _load, _save
from tierckpt import layout
from tierckpt.agent import protocol as p
from tierckpt.agent.client import PeerClient, PeerError
from tierckpt.agent.config import AgentConfig
from tierckpt.agent.store import NodeStore
from tierckpt.agent.wire import Connection
from tierckpt.errors import ConfigError
from tierckpt.tiers.integrity import verify_copy


def test_the_node_id_is_bound_into_the_macs_and_only_the_sender_deletes(node_dir, agent) -> None:
    """Item 13: a proof for another node id fails; a secret holder claiming node-a cannot delete or
    replace node-a's replicas (they are owned by node-a's token)."""
    a_dir, b_dir = node_dir("a"), node_dir("b")
    _save(a_dir, [1, 2], memory_steps_retained=2)
    b = agent(memory_dir=b_dir, node_id="node-b", secret=SECRET, replicas=0)
    base = proc_stats(os.getpid())
    conn, hello, binding = client_hello(b.address)
    mine = secrets.token_hex(32)
    conn.send({"op": "auth", "node": "node-a", "nonce": mine})
    conn.recv()
    conn.send({"op": "proof", "mac": p.client_mac(SECRET, hello["nonce"], mine, hello["node"], "node-x", binding)})
    assert conn.recv()["op"] == "error"  # the proof was made for node-x, the claim is node-a
    assert closed_by_server(conn.sock)
    owner, impostor = "a1" * 32, "e5" * 32
    legit = client_handshake(b.address, "node-a")
    assert put(legit, "node-a", 1, payload(a_dir, 1), owner=owner, keep=(1,))["op"] == "stored"
    legit.close()
    fake = client_handshake(b.address, "node-a")
    assert put(fake, "node-a", 2, payload(a_dir, 2), owner=impostor, keep=())["op"] == "stored"
    replaced = put(fake, "node-a", 1, payload(a_dir, 1), owner=impostor)
    assert replaced["op"] == "error" and "another sender" in replaced["message"]
    fake.close()
    replicas = NodeStore(b_dir, "node-b").replica("node-a", NS)
    assert [s.step for s in replicas.list_steps()] == [1, 2]  # keep=() deleted nothing it did not send
    assert verify_copy(replicas, 1, NS).ok
    serves_bit_for_bit(b.address, b_dir, "node-a", 1, replica=True)
    back_to_baseline(os.getpid(), base)


def _drain_raw(sock: socket.socket, timeout: float) -> None:
    """Read the socket's bytes below TLS (``os.read`` on its descriptor) until the peer closes."""
    deadline = time.monotonic() + timeout
    fd = sock.fileno()
    while time.monotonic() < deadline:
        if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            break
        try:
            if not os.read(fd, 1 << 16):
                return
        except OSError:
            return


class _Relay:
    """An on-path attacker between a client and the agent. ``flip_down``/``flip_up``: flip one byte of
    the server's / the client's stream at that offset; ``replay_record``: send the client's n-th
    TLS application-data record twice (None everywhere: relays faithfully)."""

    def __init__(self, target: tuple[str, int], *, flip_down: int | None = None, flip_up: int | None = None,
                 replay_record: int | None = None) -> None:
        self.target, self.flip_down, self.flip_up, self.replay = target, flip_down, flip_up, replay_record
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.address = self.sock.getsockname()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.sock.accept()
        server = socket.create_connection(self.target)
        up = self._records if self.replay is not None else self._pipe
        threading.Thread(target=up, args=(client, server, self.flip_up), daemon=True).start()
        self._pipe(server, client, self.flip_down)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, flip_at: int | None) -> None:
        seen = 0
        try:
            while chunk := src.recv(1 << 16):
                data = bytearray(chunk)
                if flip_at is not None and seen <= flip_at < seen + len(data):
                    data[flip_at - seen] ^= 0x01
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _Relay._shut(src, dst)

    def _records(self, src: socket.socket, dst: socket.socket, _: int | None) -> None:
        """Client → server by TLS record (5-byte header: type, version, length), one replayed."""
        buf, n = b"", 0
        try:
            while chunk := src.recv(1 << 16):
                buf += chunk
                while len(buf) >= 5 and len(buf) >= 5 + int.from_bytes(buf[3:5], "big"):
                    end = 5 + int.from_bytes(buf[3:5], "big")
                    record, buf = buf[:end], buf[end:]
                    n += record[0] == 23  # application data (everything after the ClientHello)
                    dst.sendall(record * (2 if record[0] == 23 and n == self.replay else 1))
        except OSError:
            pass
        finally:
            _Relay._shut(src, dst)

    @staticmethod
    def _shut(*socks: socket.socket) -> None:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.sock.close()


class _TerminatingRelay:
    """An attacker without the secret that terminates TLS on both sides (its own certificate to the
    client) and forwards every frame unchanged: only the channel binding in the MACs stops it."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.address = self.sock.getsockname()
        self.frames: list[str] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        down = raw_accept(self.sock)
        try:
            up, hello, _ = client_hello(self.target)
            serve_hello(down, hello["node"], hello["nonce"])  # the agent's own hello, our own TLS
            threading.Thread(target=self._frames, args=(down, up), daemon=True).start()
            self._frames(up, down)
        except (OSError, p.ProtocolViolation):
            down.close()

    def _frames(self, src: Connection, dst: Connection) -> None:
        try:
            while True:
                frame = src.recv()
                self.frames.append(frame["op"])
                dst.send(frame)
        except (OSError, p.ProtocolViolation):
            pass
        finally:
            src.close()
            dst.close()


def test_every_byte_is_under_tls_and_the_server_proves_itself_first(node_dir, agent) -> None:
    """Item 14 on the TLS wire: a byte rewritten on the path (either way) or a replayed TLS record
    ends the connection (and the agent counts it); a relay that terminates TLS is refused by the
    MACs; a hello stripped of TLS is refused by the client; a client checks the server's MAC
    before it sends its own proof."""
    d = node_dir("a")
    _save(d, [1])
    a = agent(memory_dir=d, node_id="node-a", secret=SECRET, replicas=0)
    base = proc_stats(os.getpid())
    relay = _Relay(a.address, flip_down=3000)  # past the handshake, inside the data file's bytes
    conn = client_handshake(relay.address, "node-legit")
    with pytest.raises(ssl.SSLError):
        get(conn, "node-a", 1, "__0_0.distcp")
    # the client sent its alert; it reads what is left raw (below TLS) until the agent, having
    # counted the alert, closes: a close with unread bytes would reset the connection, and the
    # relay could then drop the alert before the agent read it (a race CI lost once)
    _drain_raw(conn.sock, 20.0)
    conn.close()
    relay.close()
    wait_for(lambda: a._agent.metrics.rejected.value() >= 1, "the client's TLS alert counted")
    rejected = a._agent.metrics.rejected.value()
    relay = _Relay(a.address, flip_up=400)  # past the ClientHello (225 bytes) and Finished (80), in the auth frame
    with pytest.raises((PeerError, OSError, p.ProtocolViolation)):
        client = PeerClient.connect(relay.address, "node-legit", SECRET, timeout=5)
        client.list(NS)
    relay.close()
    wait_for(lambda: a._agent.metrics.rejected.value() == rejected + 1, "the altered record counted")
    relay = _Relay(a.address, replay_record=4)  # Finished, auth, proof, then the list request: twice
    client = PeerClient.connect(relay.address, "node-legit", SECRET, timeout=5)
    client.send({"op": "list", "ns": NS})
    assert client.recv()["op"] == "listing"  # answered once; the copy fails TLS's sequence numbers
    assert closed_by_server(client.sock)
    relay.close()
    wait_for(lambda: a._agent.metrics.rejected.value() == rejected + 2, "the replayed record counted")
    mitm = _TerminatingRelay(a.address)
    with pytest.raises(PeerError, match="authentication"):
        PeerClient.connect(mitm.address, "node-legit", SECRET, timeout=5)
    assert "proof" not in mitm.frames  # the client stopped at the agent's welcome
    mitm.sock.close()

    received: list[dict] = []
    impostor = socket.socket()
    impostor.bind(("127.0.0.1", 0))
    impostor.listen(2)

    def fake_server(wire: str) -> None:
        c = raw_accept(impostor)
        try:
            serve_hello(c, "node-f", "ab" * 32, wire)
            received.append(c.recv())
            c.send({"op": "welcome", "node": "node-f", "mac": "00" * 32})  # does not know the secret
            received.append(c.recv())
        except (p.ProtocolViolation, OSError):
            pass
        c.close()

    t = threading.Thread(target=fake_server, args=("insecure",), daemon=True)
    t.start()
    with pytest.raises(PeerError, match="wire"):  # TLS stripped from the hello: the client does not follow
        PeerClient.connect(impostor.getsockname(), "node-legit", SECRET, timeout=5)
    t.join(10)
    assert received == []
    t = threading.Thread(target=fake_server, args=("tls13",), daemon=True)
    t.start()
    with pytest.raises(PeerError, match="authentication"):
        PeerClient.connect(impostor.getsockname(), "node-legit", SECRET, timeout=5)
    t.join(10)
    impostor.close()
    assert [m["op"] for m in received] == ["auth"] and "mac" not in received[0]  # no proof was sent
    serves_bit_for_bit(a.address, d, "node-a", 1)
    back_to_baseline(os.getpid(), base)


def test_no_listening_beyond_loopback_without_a_secret(monkeypatch, capsys, node_dir) -> None:
    """Item 15: a typed error (exit 2 from the CLI), also for an empty secret and for host names
    that merely start with "127."."""
    from tierckpt.agent.cli import add_arguments, main

    monkeypatch.delenv("TIERCKPT_AGENT_SECRET", raising=False)
    d = node_dir("a")
    for host in ("0.0.0.0", "::", "10.1.2.3", "127.attacker.example", "node7"):
        with pytest.raises(ConfigError, match="needs a job secret"):
            AgentConfig(memory_dir=d, listen=(host, 0))
    with pytest.raises(ConfigError, match="needs a job secret"):
        AgentConfig(memory_dir=d, listen=("0.0.0.0", 0), secret=b"")
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        AgentConfig(memory_dir=d, listen=(host, 0))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for listen in ("0.0.0.0:0", "127.attacker.example:7601"):
        assert main(parser.parse_args(["serve", "--memory-dir", d, "--listen", listen])) == 2
        assert "needs a job secret" in capsys.readouterr().err
    assert not Path(d, layout.AGENT_SOCKET).exists()


def _modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath, name)
            out[str(full.relative_to(root))] = stat.S_IMODE(os.lstat(full).st_mode)
    return out


def test_replicas_cache_and_the_local_socket_are_private_from_creation(node_dir, agent) -> None:
    """Item 16: with a umask that would allow anything, every replica and peer-cache file is 0600,
    every directory 0700, and the socket 0600 as soon as it exists."""
    old = os.umask(0)
    try:
        a_dir, b_dir = node_dir("a"), node_dir("b")
        b = agent(memory_dir=b_dir, node_id="node-b", secret=SECRET)
        a = agent(memory_dir=a_dir, node_id="node-a", peers=(b.address,), secret=SECRET)
        _save(a_dir, [1])
        wait_for(lambda: Path(b_dir, layout.REPLICAS, "node-a", NS, "step_1", layout.MARKER).exists(), "replica")
        lose_namespace(a, a_dir, NS, ["node-b"])
        step, tiers, _ = _load(a_dir)  # fetched back into a's peer cache
        assert (step, tiers) == (1, ["peer"])
        for root, area in ((b_dir, layout.REPLICAS), (a_dir, layout.PEER_CACHE)):
            modes = _modes(Path(root, area))
            assert modes, area
            for path, mode in modes.items():
                is_dir = Path(root, area, path).is_dir()
                assert mode == (0o700 if is_dir else 0o600), (area, path, oct(mode))
        for root in (a_dir, b_dir):
            assert stat.S_IMODE(os.stat(Path(root, layout.AGENT_SOCKET)).st_mode) == 0o600
            assert stat.S_IMODE(os.stat(Path(root, ".agent-owner")).st_mode) == 0o600
        assert a.node_id == "node-a"
    finally:
        os.umask(old)
