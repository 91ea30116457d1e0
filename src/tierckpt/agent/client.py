"""The client side of a peer connection, over ``wire.Connection``.

Call order: ``PeerClient.connect(addr, node_id, secret)`` (the plaintext hello, its wire checked
against ours → TLS 1.3 → auth → welcome, the server's MAC over the certificate we saw checked
→ proof) → ``list`` / ``get_into`` / ``put`` / ``status``, one at a time → ``close``.
``connect``'s ``timeout`` bounds the whole handshake.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tierckpt.agent import protocol as p
from tierckpt.agent.tls import client_wrap, peer_end_point
from tierckpt.agent.transfer import StreamCheck
from tierckpt.agent.wire import Connection
from tierckpt.errors import IntegrityError, TierckptError

__all__ = ["Connection", "PeerClient", "PeerError", "ask_all"]  # Connection: from wire

T = TypeVar("T")


class PeerError(TierckptError):
    """The peer answered with an error, or the connection failed (the message says which)."""


class PeerClient(Connection):
    """An authenticated connection to another agent; ``node`` is the id it proved."""

    def __init__(self, sock: socket.socket, node: str) -> None:
        super().__init__(sock)
        self.node = node

    @classmethod
    def connect(cls, address: tuple[str, int], node_id: str, secret: bytes | None, *,
                timeout: float = 30.0, source: tuple[str, int] | None = None, insecure: bool = False) -> PeerClient:
        """``insecure``: this agent runs the insecure wire (``AgentConfig.insecure_wire``), and so must the peer."""
        if not secret:
            raise PeerError(f"no job secret, so no peer connection (to {address[0]}:{address[1]}): start every agent "
                            "with the same --secret-file or $TIERCKPT_AGENT_SECRET")
        try:
            sock = socket.create_connection(address, timeout=timeout, source_address=source)
        except OSError as exc:
            raise PeerError(f"cannot connect to agent {address[0]}:{address[1]}: {exc}") from exc
        client = cls(sock, "")
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client.set_deadline(timeout)
            client.node = client._handshake(node_id, secret, "insecure" if insecure else "tls13")
            client.set_deadline(None)
        except (OSError, p.ProtocolViolation) as exc:  # ssl.SSLError is an OSError
            client.close()
            raise PeerError(f"handshake with agent {address[0]}:{address[1]} failed: {exc}") from exc
        except PeerError:
            client.close()
            raise
        return client

    def _handshake(self, node_id: str, key: bytes, wire: str) -> str:
        hello = self.recv()
        if hello.get("op") != "hello":
            raise PeerError(f"agent refused us: {hello.get('message', hello.get('op'))}")
        server_node = p.validate_node_id(hello.get("node"))
        server_nonce = p.validate_nonce(hello.get("nonce"))
        if hello.get("wire") != wire:  # never follow a peer (or someone on the path) to a weaker wire
            raise PeerError(f"agent {server_node} runs the {str(hello.get('wire'))[:16]!r} wire, this one {wire!r}: "
                            "start every agent of the job with --insecure-wire, or none")
        end_point = b""
        if wire == "tls13":
            self.start_tls(client_wrap)
            end_point = peer_end_point(self.sock)  # type: ignore[arg-type]  # an SSLSocket now
        mine = secrets.token_hex(32)
        self.send({"op": "auth", "node": node_id, "nonce": mine})
        welcome = self.recv()
        if welcome.get("op") != "welcome":
            raise PeerError(f"agent {server_node} refused us: {welcome.get('message', welcome.get('op'))}")
        ids = (server_nonce, mine, server_node, node_id, p.channel_binding(wire, end_point))
        p.check_mac(p.server_mac(key, *ids), welcome.get("mac"))  # the server proves itself first
        self.send({"op": "proof", "mac": p.client_mac(key, *ids)})
        return server_node

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        self.send(message)
        reply = self.recv()
        if reply.get("op") == "error":
            raise PeerError(f"agent {self.node}: {reply.get('message')}")
        return reply

    def list_entries(self, namespace: str, *, max_frames: int = 64) -> tuple[list[p.ListingEntry], int]:
        """The peer's listing of ``namespace``, pieces merged: (valid entries, entries dropped as invalid)."""
        self.send({"op": "list", "ns": namespace})
        merged: dict[tuple[int, str, str], p.ListingEntry] = {}
        bad = 0
        for _ in range(max_frames):
            reply = self.recv()
            if reply.get("op") == "error":
                raise PeerError(f"agent {self.node}: {reply.get('message')}")
            steps = reply.get("steps")
            for raw in steps if isinstance(steps, list) else []:
                try:
                    e = p.parse_listing_entry(raw)
                except p.ProtocolViolation:
                    bad += 1
                    continue
                key = (e.step, e.origin, e.save_id)
                old = merged.get(key)
                merged[key] = e if old is None else p.ListingEntry(
                    e.step, e.origin, e.save_id, {**old.held, **e.held}, old.all_files + e.all_files)
            if not reply.get("more"):
                return list(merged.values()), bad
        raise p.ProtocolViolation(f"agent {self.node} sent a listing of more than {max_frames} frames")

    def list(self, namespace: str) -> list[dict[str, Any]]:
        entries, _ = self.list_entries(namespace)
        return [{"step": e.step, "origin": e.origin, "save_id": e.save_id, "held": e.held, "all": list(e.all_files)}
                for e in entries]

    def get_into(self, namespace: str, origin: str, step: int, name: str, dest: Path, *,
                 max_size: int = p.MAX_FILE, expect_size: int | None = None,
                 check: StreamCheck | None = None) -> int:
        """Fetch one file into ``dest`` (created), its items checked on the way by ``check``; its size.

        ``expect_size`` (the manifest's) is compared before any byte is received; a mismatch
        raises ``IntegrityError`` and the connection is of no further use.
        """
        reply = self.call({"op": "get", "ns": namespace, "origin": origin, "step": step, "name": name})
        size = reply.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= max_size:
            raise p.ProtocolViolation(f"bad size {size!r} for {name}")
        if expect_size is not None and size != expect_size:
            raise IntegrityError(f"agent {self.node} holds {name} with {size} bytes, the manifest says {expect_size}")
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            self.recv_into_file(fd, size, check)
        finally:
            os.close(fd)
        return size

    def get_range_into(self, namespace: str, origin: str, step: int, name: str, fd: int, offset: int, length: int,
                       check: StreamCheck | None) -> None:
        """Fetch bytes ``[offset, offset + length)`` of one file into ``fd`` at the same offset."""
        reply = self.call({"op": "get", "ns": namespace, "origin": origin, "step": step, "name": name,
                           "offset": offset, "length": length})
        if reply.get("size") != length:
            raise p.ProtocolViolation(f"asked for {length} bytes of {name}, offered {reply.get('size')!r}")
        self.recv_into_file(fd, length, check, at=offset)

    def put(self, namespace: str, origin: str, step: int, save_id: str, files: Sequence[tuple[str, Path | bytes]],
            keep: Sequence[int], owner: str) -> None:
        """Send a step's files (paths mapped and sent with sendfile, bytes as they are); returns once
        stored, or when the peer already holds this save."""
        sizes = [(n, src.stat().st_size if isinstance(src, Path) else len(src)) for n, src in files]
        reply = self.call({"op": "put", "ns": namespace, "origin": origin, "step": step, "save_id": save_id,
                           "files": [[n, s] for n, s in sizes], "keep": list(keep), "owner": owner})
        if reply.get("op") == "held":
            return
        if reply.get("op") != "ready":
            raise PeerError(f"agent {self.node} did not accept step {step}: {reply.get('op')}")
        for (_, src), (_, size) in zip(files, sizes, strict=True):
            if isinstance(src, Path):
                fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    if os.fstat(fd).st_size != size:
                        raise PeerError(f"{src} changed size while being sent")
                    self.send_fd(fd, 0, size)
                finally:
                    os.close(fd)
            else:
                self.send_bytes(src)
        reply = self.recv()
        if reply.get("op") != "stored":
            raise PeerError(f"agent {self.node} did not store step {step}: {reply.get('message')}")


def ask_all(addresses: Sequence[tuple[str, int]], ask: Callable[[tuple[str, int]], T], deadline_s: float
            ) -> dict[tuple[str, int], T]:
    """``ask(address)`` for every peer at once, each in its own daemon thread; the answers that came
    within ``deadline_s`` (a peer that failed or is still stuck is left out, and delays nobody).

    ``ask`` must bound its own I/O (connect with ``timeout``, ``set_deadline``) so a stuck
    peer's thread ends soon after the deadline instead of piling up.
    """
    answers: dict[tuple[str, int], T] = {}
    lock = threading.Lock()

    def one(addr: tuple[str, int]) -> None:
        try:
            value = ask(addr)
        except (PeerError, p.ProtocolViolation, OSError):
            return
        with lock:
            answers[addr] = value

    threads = [threading.Thread(target=one, args=(a,), name="tierckpt-agent-ask", daemon=True) for a in addresses]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    with lock:
        return dict(answers)
