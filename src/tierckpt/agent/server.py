"""The agent's two listeners: TCP for peers (TLS 1.3, authenticated) and a Unix socket for this node's trainers.

Each connection runs in its own daemon thread, at most ``limits.max_connections`` of them
(``max_per_address`` from one address); more are closed on accept. A peer connection is:
hello → TLS (unless the insecure wire) → auth → welcome → proof within ``handshake_s``, then
requests until the peer closes: each waits at most ``idle_s`` for its first byte, then has
``request_s`` for the rest of its frame and the answer (bulk bytes: ``bulk_s``). Anything
that breaks the protocol (garbage, a failed TLS record or handshake, a bad MAC, a truncated
frame, a path-like name, an oversize length, a deadline) is counted, answered with an
``error`` frame where the stream still allows one, and closes that connection only. The accept loop outlives a failed ``accept`` (EMFILE at the descriptor limit) or a
thread that cannot start: it logs once, backs off briefly and goes on. A local connection
carries one JSON line and gets one JSON line back.

The servers know nothing of what a request means: ``service.Agent`` hands them ``handle_peer``
(a parsed request, the connection, the authenticated peer's node id), ``handle_local`` (a
request object → the reply object, or None for no reply) and ``rejected`` (one connection
closed for breaking the protocol: counted).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import socketserver
import ssl
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from tierckpt.agent import protocol as p
from tierckpt.agent.tls import ServerTLS
from tierckpt.agent.wire import Connection
from tierckpt.errors import AgentRunningError
from tierckpt.node.sock import short_path
from tierckpt.observability import get_logger

__all__ = ["LocalHandler", "LocalServer", "PeerHandler", "PeerLimits", "PeerServer"]

MAX_LOCAL_LINE = 1 << 16
ACCEPT_BACKOFF_S = 0.1
_log = get_logger("agent")

PeerHandler = Callable[[p.Request, Connection, str], None]
LocalHandler = Callable[[dict[str, Any]], dict[str, Any] | None]


class PeerLimits(Protocol):
    """The bounds a peer listener keeps (``AgentLimits`` has them)."""

    @property
    def max_connections(self) -> int: ...
    @property
    def max_per_address(self) -> int: ...
    @property
    def handshake_s(self) -> float: ...
    @property
    def idle_s(self) -> float: ...
    @property
    def request_s(self) -> float: ...


class PeerServer:
    """Accepts peers on ``address``; ``close()`` stops accepting and ends live connections."""

    def __init__(self, host: str, port: int, *, node_id: str, secret: bytes, limits: PeerLimits, insecure_wire: bool,
                 handle_peer: PeerHandler, rejected: Callable[[], None]) -> None:
        self.node_id = node_id
        self.secret = secret
        self.handle_peer = handle_peer
        self.rejected = rejected
        self.limits = limits
        self.wire = "insecure" if insecure_wire else "tls13"
        self.tls = None if insecure_wire else ServerTLS.create()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.sock.settimeout(0.5)  # close() is noticed without a connection arriving
        self.address: tuple[str, int] = (host, int(self.sock.getsockname()[1]))
        self._conns: dict[socket.socket, str] = {}
        self._live: dict[socket.socket, Connection] = {}  # the TLS socket replaces the accepted one
        self._per_address: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._closed = False
        self._logged: set[str] = set()  # each kind of accept trouble is logged once
        self._thread = threading.Thread(target=self._accept_loop, name="tierckpt-agent-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self.sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._closed:
                    return
                self._trouble(f"accept failed: {exc}", exc.errno or 0)
                continue
            try:
                self._admit(sock, str(addr[0]))
            except (RuntimeError, OSError) as exc:  # RuntimeError: "can't start new thread"
                self._drop(sock)
                self._trouble(f"a connection could not be served: {exc}", getattr(exc, "errno", 0) or 0)

    def _trouble(self, message: str, code: int) -> None:
        key = f"{type(message)}:{code}:{message.split(':')[0]}"
        if key not in self._logged:
            self._logged.add(key)
            _log.error("[Agent %s] %s (logged once; the listener backs off %.1fs and keeps accepting)",
                       self.node_id, message, ACCEPT_BACKOFF_S)
        if code in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, 0):
            time.sleep(ACCEPT_BACKOFF_S)  # the condition lasts a while: do not spin on it

    def _admit(self, sock: socket.socket, host: str) -> None:
        with self._lock:
            full = len(self._conns) >= self.limits.max_connections
            if full or self._per_address[host] >= self.limits.max_per_address:
                self.rejected()
                sock.close()
                return
            self._conns[sock] = host
            self._per_address[host] += 1
        try:
            # replies are small frames followed by file bytes: without this each small
            # file waits out Nagle + the client's delayed ACK (40 ms a file, measured)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        threading.Thread(target=self._serve, args=(sock,), name="tierckpt-agent-peer", daemon=True).start()

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            host = self._conns.pop(sock, None)
            if host is not None:
                self._per_address[host] -= 1
                if self._per_address[host] <= 0:
                    del self._per_address[host]
        try:
            sock.close()
        except OSError:
            pass

    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def _serve(self, sock: socket.socket) -> None:
        conn = Connection(sock, step_timeout=self.limits.idle_s)
        with self._lock:
            self._live[sock] = conn
        try:
            conn.set_deadline(self.limits.handshake_s)
            peer = self._handshake(conn)
            while not self._closed:
                conn.set_deadline(None)
                if not conn.wait_readable(self.limits.idle_s):
                    raise p.ProtocolViolation(f"closed after {self.limits.idle_s:g}s idle")
                conn.set_deadline(self.limits.request_s)  # the whole frame, then the answer
                try:
                    body = conn.recv()
                except p.ProtocolViolation as exc:
                    if "after 0 of" in str(exc):
                        return  # the peer closed between requests
                    raise
                self.handle_peer(p.parse_request(body), conn, peer)
        except (p.ProtocolViolation, TimeoutError, ssl.SSLError) as exc:
            self.rejected()
            message = (str(exc) if isinstance(exc, p.ProtocolViolation) else f"TLS failed: {exc}"
                       if isinstance(exc, ssl.SSLError) else f"ran past its deadline ({exc})")
            _log.warning("[Agent %s] closed a peer connection: %s", self.node_id, message)
            try:
                conn.set_deadline(1.0)
                conn.send({"op": "error", "message": message[:500]})
            except (OSError, p.ProtocolViolation):
                pass
        except OSError as exc:
            _log.info("[Agent %s] peer connection ended: %s", self.node_id, exc)
        finally:
            with self._lock:
                self._live.pop(sock, None)
            conn.close()
            self._drop(sock)

    def _handshake(self, conn: Connection) -> str:
        nonce = secrets.token_hex(32)
        me = self.node_id
        conn.send({"op": "hello", "node": me, "nonce": nonce, "wire": self.wire})
        end_point = b""
        if self.tls is not None:
            conn.start_tls(self.tls.wrap)
            end_point = self.tls.end_point
        auth = conn.recv()
        if auth.get("op") != "auth":
            raise p.ProtocolViolation("expected auth")
        peer = p.validate_node_id(auth.get("node"))
        ids = (nonce, p.validate_nonce(auth.get("nonce")), me, peer, p.channel_binding(self.wire, end_point))
        key = self.secret
        conn.send({"op": "welcome", "node": me, "mac": p.server_mac(key, *ids)})
        proof = conn.recv()
        if proof.get("op") != "proof":
            raise p.ProtocolViolation("expected proof")
        p.check_mac(p.client_mac(key, *ids), proof.get("mac"))
        return peer

    def close(self) -> None:
        self._closed = True
        self.sock.close()
        with self._lock:
            for s in list(self._conns):
                live = self._live.get(s)
                try:
                    (s if live is None else live.sock).shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._thread.join(timeout=5)


class _LocalHandler(socketserver.StreamRequestHandler):
    server: _LocalUnixServer

    def handle(self) -> None:
        self.request.settimeout(self.server.idle_s)  # a silent client is closed
        try:
            line = self.rfile.readline(MAX_LOCAL_LINE + 1)
        except OSError:
            return
        if not line or len(line) > MAX_LOCAL_LINE:
            return
        self.request.settimeout(None)  # a flush may take long: the client decides how long it waits
        try:
            if p.too_deep(line):
                raise p.ProtocolViolation(f"request nests deeper than {p.MAX_DEPTH} levels")
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError("not an object")
            reply = self.server.handle_local(request)
        except (ValueError, RecursionError, p.ProtocolViolation) as exc:
            reply = {"ok": False, "kind": "request", "error": str(exc)[:500]}
        if reply is None:
            return
        try:
            self.wfile.write(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass  # a notifier that does not wait for replies


class _LocalUnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    handle_local: LocalHandler
    idle_s: float

    def server_bind(self) -> None:
        """Bind inside a fresh 0700 directory, make the socket 0600, then link it into place:
        no moment exists when others could connect (no process-wide umask change needed). The
        link fails if the name exists, so of two agents starting on one root at once exactly
        one takes it (a rename would silently replace the other's socket)."""
        final = str(self.server_address)
        private = tempfile.mkdtemp(prefix=".agent-sock-", dir=os.path.dirname(final))
        try:
            path = os.path.join(private, "s")
            with short_path(path) as where:  # a deep memory root: beyond sun_path's 108 bytes
                self.socket.bind(where)
            os.chmod(path, 0o600)
            self.socket.listen(self.request_queue_size)  # before the name: a rival's probe must find it answering
            for _ in range(3):
                try:
                    os.link(path, final)
                    break
                except FileExistsError:
                    _clear_stale(Path(final))  # raises AgentRunningError if an agent answers there
            else:
                raise AgentRunningError(f"could not take {final}: it reappears as fast as it is removed")
            os.unlink(path)
        finally:
            try:
                os.unlink(os.path.join(private, "s"))
            except FileNotFoundError:
                pass
            os.rmdir(private)
        self.server_address = final


def _clear_stale(path: Path) -> None:
    """Remove ``path`` if no agent answers on it (left by one that died); raise
    ``AgentRunningError`` if one does."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with short_path(path) as where:
            probe.connect(where)
        raise AgentRunningError(f"an agent already serves {path.parent}; stop it first")
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)
    finally:
        probe.close()


class LocalServer:
    """``<memory root>/.agent.sock``: commit notices and load-time requests from this node."""

    def __init__(self, path: Path, *, handle_local: LocalHandler, idle_s: float) -> None:
        self.path = path
        if path.exists():
            _clear_stale(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.server = _LocalUnixServer(str(path), _LocalHandler)
        self.server.handle_local = handle_local
        self.server.idle_s = idle_s
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
