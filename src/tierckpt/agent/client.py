"""Blocking I/O around the sans-IO protocol: a framed connection, and the client side of a peer.

Call order (client): ``PeerClient.connect(addr, node_id, secret)`` (hello → auth → welcome) →
``list`` / ``get_into`` / ``put`` / ``status``, one at a time → ``close``.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierckpt.agent import protocol as p
from tierckpt.agent.transfer import StreamCheck, TransferClosed, receive_into_file
from tierckpt.errors import IntegrityError

__all__ = ["Connection", "PeerClient", "PeerError"]


class PeerError(Exception):
    """The peer answered with an error, or the connection failed (the message says which)."""


class Connection:
    """One framed socket; every read has the socket's timeout."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(p.encode(message))

    def recv(self) -> dict[str, Any]:
        length = p.parse_header(self._exact(p.HEADER.size))
        return p.decode_body(self._exact(length))

    def _exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise p.ProtocolViolation(f"connection closed after {got} of {n} bytes")
            got += k
        return bytes(buf)

    def recv_into_file(self, fd: int, size: int, check: StreamCheck | None = None, *, at: int | None = None) -> None:
        """Receive exactly ``size`` raw bytes into an open file (at its position, or at offset ``at``),
        checking items on the way if asked."""
        try:
            receive_into_file(self.sock, fd, size, check, at=at)
        except TransferClosed as exc:
            raise p.ProtocolViolation(str(exc)) from None

    def send_file(self, path: Path, size: int, offset: int = 0, length: int | None = None) -> None:
        """Send ``length`` bytes (default: all) of ``path``, ``size`` bytes long, from ``offset``,
        with sendfile (no copy through user space)."""
        count = size - offset if length is None else length
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size != size:
                raise PeerError(f"{path} changed size while being sent")
            # socket.sendfile: os.sendfile under the hood, waiting for room within the socket's timeout
            sent = self.sock.sendfile(f, offset, count) if count else 0
            if sent != count:
                raise PeerError(f"short send of {path}: {sent} of {count} bytes")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class PeerClient(Connection):
    """An authenticated connection to another agent; ``node`` is the id it reported."""

    def __init__(self, sock: socket.socket, node: str) -> None:
        super().__init__(sock)
        self.node = node

    @classmethod
    def connect(cls, address: tuple[str, int], node_id: str, secret: bytes | None, *,
                timeout: float = 30.0) -> PeerClient:
        try:
            sock = socket.create_connection(address, timeout=timeout)
        except OSError as exc:
            raise PeerError(f"cannot connect to agent {address[0]}:{address[1]}: {exc}") from exc
        conn = Connection(sock)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = conn.recv()
            if hello.get("op") != "hello":
                raise p.ProtocolViolation("expected hello")
            server_node = p.validate_node_id(hello.get("node"))
            server_nonce = p.validate_nonce(hello.get("nonce"))
            mine = secrets.token_hex(32)
            key = secret or b""
            conn.send({"op": "auth", "node": node_id, "nonce": mine, "mac": p.client_mac(key, server_nonce, mine)})
            welcome = conn.recv()
            if welcome.get("op") != "welcome":
                raise PeerError(f"agent {address[0]}:{address[1]} refused us: {welcome.get('message', welcome.get('op'))}")
            p.check_mac(p.server_mac(key, mine, server_nonce), welcome.get("mac"))
        except (OSError, p.ProtocolViolation) as exc:
            conn.close()
            raise PeerError(f"handshake with agent {address[0]}:{address[1]} failed: {exc}") from exc
        except PeerError:
            conn.close()
            raise
        return cls(sock, server_node)

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        self.send(message)
        reply = self.recv()
        if reply.get("op") == "error":
            raise PeerError(f"agent {self.node}: {reply.get('message')}")
        return reply

    def list(self, namespace: str) -> list[dict[str, Any]]:
        steps = self.call({"op": "list", "ns": namespace}).get("steps", [])
        return steps if isinstance(steps, list) else []

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
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
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
            keep: Sequence[int]) -> None:
        """Send a step's files (paths go by sendfile, bytes as they are); returns once stored."""
        sizes = [(n, src.stat().st_size if isinstance(src, Path) else len(src)) for n, src in files]
        self.send({"op": "put", "ns": namespace, "origin": origin, "step": step, "save_id": save_id,
                   "files": [[n, s] for n, s in sizes], "keep": list(keep)})
        for (_, src), (_, size) in zip(files, sizes, strict=True):
            if isinstance(src, Path):
                self.send_file(src, size)
            else:
                self.sock.sendall(src)
        reply = self.recv()
        if reply.get("op") != "stored":
            raise PeerError(f"agent {self.node} did not store step {step}: {reply.get('message')}")
