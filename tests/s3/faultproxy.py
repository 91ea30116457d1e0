"""A fault-injecting HTTP proxy for S3 tests, listening on 127.0.0.1.

    with FaultProxy(upstream="http://127.0.0.1:8333") as proxy:
        proxy.add(Fault("slowdown", method="PUT", path=r"partNumber=2", times=2))
        client pointed at proxy.url ...
        proxy.log   # [(method, path with query, status or action), ...] in arrival order

Each request is read whole from the client (answering ``Expect: 100-continue`` itself), then a
matching rule's action runs; without one the request goes to the upstream unchanged (the Host
header too, so SigV4 signatures stay valid) and the reply comes back with a Content-Length.
Actions:
  slowdown       503 SlowDown, without asking the upstream
  internal       500 InternalError, without asking the upstream
  reset          forward, send the reply's head and half its body, then reset the connection
  reset_request  reset the connection instead of answering (the request never reaches S3)
  delay          forward, then wait ``seconds`` before answering (past a client read timeout)
  reply          answer ``status`` with ``body`` (e.g. 501 NotImplemented), without the upstream
"""

from __future__ import annotations

import http.client
import http.server
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

__all__ = ["Fault", "FaultProxy"]

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "expect", "te", "upgrade"}


def s3_error(code: str, message: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message><RequestId>faultproxy</RequestId></Error>"
    ).encode()


@dataclass
class Fault:
    """Do ``action`` to the next ``times`` requests matching ``method``, ``path`` and ``header``.

    ``path`` is a regular expression searched in the path with its query; ``header`` a header
    name that must be present. ``times=None`` never runs out.
    """

    action: str
    method: str | None = None
    path: str | None = None
    header: str | None = None
    times: int | None = 1
    seconds: float = 0.0
    status: int = 501
    body: bytes = b""
    hits: int = field(default=0, init=False)

    def matches(self, method: str, path: str, headers: http.client.HTTPMessage) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if self.method is not None and method != self.method:
            return False
        if self.path is not None and not re.search(self.path, path):
            return False
        return self.header is None or self.header in headers


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        parsed = urlparse(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.faults: list[Fault] = []
        self.log: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="faultproxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()
            self.log.clear()

    def pick(self, method: str, path: str, headers: http.client.HTTPMessage) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.matches(method, path, headers):
                    fault.hits += 1
                    return fault
        return None

    def record(self, method: str, path: str, outcome: str) -> None:
        with self._lock:
            self.log.append((method, path, outcome))

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and 100-continue answered by the base class
    owner: FaultProxy

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except (ConnectionError, OSError):  # the client went away or we reset it on purpose
            self.close_connection = True

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        method, path = self.command, self.path
        fault = self.owner.pick(method, path, self.headers)
        action = fault.action if fault else "forward"
        if action == "reset_request":
            self.owner.record(method, path, action)
            return self._reset()
        if action == "slowdown":
            self.owner.record(method, path, "503")
            return self._answer(503, s3_error("SlowDown", "Please reduce your request rate."))
        if action == "internal":
            self.owner.record(method, path, "500")
            return self._answer(500, s3_error("InternalError", "We encountered an internal error."))
        if action == "reply":
            assert fault is not None
            self.owner.record(method, path, str(fault.status))
            return self._answer(fault.status, fault.body)
        status, reason, headers, payload = self._forward(method, path, body)
        if action == "delay":
            assert fault is not None
            self.owner.record(method, path, "delay")
            time.sleep(fault.seconds)
        if action == "reset":
            self.owner.record(method, path, "reset")
            self._send_head(status, reason, headers, len(payload))
            if method != "HEAD":
                self.wfile.write(payload[: len(payload) // 2])
                self.wfile.flush()
            return self._reset()
        if action != "delay":
            self.owner.record(method, path, str(status))
        self._send_head(status, reason, headers, len(payload))
        if method != "HEAD":
            self.wfile.write(payload)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve

    def _forward(self, method: str, path: str, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.owner.upstream, timeout=60)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    conn.putheader(name, value)
            if "Content-Length" not in self.headers and body:
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            resp = conn.getresponse()
            payload = resp.read()
            headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP | {"content-length"}]
            if method == "HEAD":  # keep the object's length for the client
                headers.append(("Content-Length", resp.getheader("Content-Length", "0")))
            return resp.status, resp.reason, headers, payload
        finally:
            conn.close()

    def _send_head(self, status: int, reason: str, headers: list[tuple[str, str]], length: int) -> None:
        self.send_response_only(status, reason)
        for name, value in headers:
            self.send_header(name, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _reset(self) -> None:
        """Close with RST (SO_LINGER 0): the client sees 'connection reset by peer'."""
        self.close_connection = True
        try:
            self.wfile.flush()
        except OSError:
            pass
        sock = self.connection
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.rfile.close()  # drop the file's hold on the socket so close() is immediate
        sock.close()
