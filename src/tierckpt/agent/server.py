"""The agent's two listeners: TCP for peers (authenticated) and a Unix socket for this node's trainers.

Each connection runs in its own daemon thread. A peer connection is: hello → auth → welcome,
then requests until the peer closes; anything that breaks the protocol (garbage, a bad MAC, a
truncated frame, a path-like name, an oversize length) closes that connection only. A local
connection carries one JSON line and gets one JSON line back.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import socketserver
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierckpt.agent import protocol as p
from tierckpt.agent.client import Connection
from tierckpt.observability import get_logger

if TYPE_CHECKING:
    from tierckpt.agent.service import Agent

__all__ = ["LocalServer", "PeerServer"]

IDLE_TIMEOUT_S = 120.0
HANDSHAKE_TIMEOUT_S = 10.0
MAX_LOCAL_LINE = 1 << 16
_log = get_logger("agent")


class PeerServer:
    """Accepts peers on ``address``; ``close()`` stops accepting and ends live connections."""

    def __init__(self, agent: Agent, host: str, port: int) -> None:
        self.agent = agent
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(64)
        self.address: tuple[str, int] = (host, int(self.sock.getsockname()[1]))
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="tierckpt-agent-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self.sock.accept()
            except OSError:
                return
            try:
                # replies are small frames followed by file bytes: without this each small
                # file waits out Nagle + the client's delayed ACK (40 ms a file, measured)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            with self._lock:
                self._conns.add(sock)
            threading.Thread(target=self._serve, args=(sock,), name="tierckpt-agent-peer", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        conn = Connection(sock)
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            peer = self._handshake(conn)
            sock.settimeout(IDLE_TIMEOUT_S)
            while not self._closed:
                try:
                    body = conn.recv()
                except p.ProtocolViolation as exc:
                    if "after 0 of" in str(exc):
                        return  # the peer closed between requests
                    raise
                self.agent.handle_peer(p.parse_request(body), conn, peer)
        except p.ProtocolViolation as exc:
            self.agent.metrics.rejected.inc()
            _log.warning("[Agent %s] closed a peer connection: %s", self.agent.node_id, exc)
            try:
                conn.send({"op": "error", "message": str(exc)[:500]})
            except OSError:
                pass
        except OSError as exc:
            _log.info("[Agent %s] peer connection ended: %s", self.agent.node_id, exc)
        finally:
            with self._lock:
                self._conns.discard(sock)
            conn.close()

    def _handshake(self, conn: Connection) -> str:
        nonce = secrets.token_hex(32)
        conn.send({"op": "hello", "node": self.agent.node_id, "nonce": nonce})
        auth = conn.recv()
        if auth.get("op") != "auth":
            raise p.ProtocolViolation("expected auth")
        peer = p.validate_node_id(auth.get("node"))
        theirs = p.validate_nonce(auth.get("nonce"))
        key = self.agent.config.secret or b""
        p.check_mac(p.client_mac(key, nonce, theirs), auth.get("mac"))
        conn.send({"op": "welcome", "node": self.agent.node_id, "mac": p.server_mac(key, theirs, nonce)})
        return peer

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        with self._lock:
            for s in list(self._conns):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._thread.join(timeout=5)


class _LocalHandler(socketserver.StreamRequestHandler):
    server: _LocalUnixServer

    def handle(self) -> None:
        line = self.rfile.readline(MAX_LOCAL_LINE + 1)
        if not line or len(line) > MAX_LOCAL_LINE:
            return
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError("not an object")
            reply = self.server.agent.handle_local(request)
        except (ValueError, p.ProtocolViolation) as exc:
            reply = {"ok": False, "kind": "request", "error": str(exc)[:500]}
        if reply is None:
            return
        try:
            self.wfile.write(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass  # a notifier that does not wait for replies


class _LocalUnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    agent: Agent


class LocalServer:
    """``<memory root>/.agent.sock``: commit notices and load-time requests from this node."""

    def __init__(self, agent: Agent, path: Path) -> None:
        self.path = path
        if path.exists():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
                raise RuntimeError(f"an agent already serves {path.parent}; stop it first")
            except (ConnectionRefusedError, FileNotFoundError):
                path.unlink(missing_ok=True)  # left by an agent that died
            finally:
                probe.close()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.server = _LocalUnixServer(str(path), _LocalHandler)
        self.server.agent = agent
        os.chmod(path, 0o600)
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="tierckpt-agent-local", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        try:
            if self.path.exists():
                self.path.unlink()
        except OSError:
            pass
        self._thread.join(timeout=5)


def reply_error(message: str, kind: str = "storage") -> dict[str, Any]:
    return {"ok": False, "kind": kind, "error": message}
