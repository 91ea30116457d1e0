"""The agent's HTTP API (``--server-port``, as ``hyperpodrun``'s): health, status, restart count.

    status = AgentStatus()
    events.listen(status.on_event)                 # every event moves the status (events.py)
    api = AgentApi.start(ApiSettings(port=8080), status)
    ...                                            # GET /health, /status, /restart_count
    api.close()

Call order: the supervisor builds ``AgentStatus`` and the server once, before the first
rendezvous (so a probe sees ``INIT`` while the node waits for its peers), hands ``on_event`` to
its ``Events``, and closes the server last. The server answers from a daemon thread; the status
is only written by ``on_event`` (the loop's thread) under a lock, so a request never blocks the
loop. Read-only: HyperPod's operator drives its agents through ``/start`` and ``/stop``; here the
agents drive themselves through the rendezvous store, and the API reports what they do.

States (HyperPod's agent states, where one applies): ``INIT`` (before the first start),
``SPARE`` (standing by at the spare gate), ``RUNNING``, ``FAULTED`` (a fault claimed),
``STOPPING`` (the workers stopped; the recovery is deciding), ``COMPLETED`` (exit 0),
``FULL_RESTART`` (exit 75, the scheduler recreates the job), ``FAILED`` (any other exit).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tierckpt.errors import ConfigError

__all__ = ["AgentApi", "AgentStatus", "ApiSettings"]

#: exit code of a full job restart (options.FULL_RESTART_EXIT; options imports the wings, this leaf does not)
_FULL_RESTART_EXIT = 75


@dataclass(frozen=True, kw_only=True)
class ApiSettings:
    """``--server-host`` / ``--server-port``: where the API listens (port None: no API; 0: any free port)."""

    host: str = "127.0.0.1"
    port: int | None = None

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ConfigError(f"--server-port must be a TCP port 0-65535 (0: any free one), got {self.port}")
        if not self.host:
            raise ConfigError("--server-host must name an address to listen on, e.g. 127.0.0.1 or 0.0.0.0")


class AgentStatus:
    """What ``/status`` reports, kept up to date from the agent's events (``on_event``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "INIT"
        self._since = time.time()
        self._transitions: dict[str, float] = {"INIT": round(self._since, 6)}
        self._generation = 0
        self._restarts: dict[str, int] = {}
        self._fields: dict[str, Any] = {"node": None, "nnodes": None, "world_size": None, "host": None,
                                        "last_fault": None, "exit_code": None, "step": None}

    def on_event(self, rec: dict[str, Any]) -> None:
        """One event record (``Events.emit``'s), in the order the agent emitted them."""
        event = rec.get("event")
        with self._lock:
            self._generation = int(rec.get("generation") or 0)
            self._fields["node"], self._fields["host"] = rec.get("node"), rec.get("host")
            if event == "started":
                self._fields.update(nnodes=rec.get("nnodes"), world_size=rec.get("world_size"))
                self._move("RUNNING", rec)
            elif event == "spare" and rec.get("state") in ("standby", "avoided"):
                self._move("SPARE", rec)
            elif event == "fault":
                self._fields["last_fault"] = {k: rec.get(k) for k in ("reason", "node", "rank", "generation", "time")}
                self._move("FAULTED", rec)
            elif event == "stopped":
                self._move("STOPPING", rec)
            elif event == "restart":
                kind = str(rec.get("kind"))
                self._restarts[kind] = self._restarts.get(kind, 0) + 1
                if kind != "job":
                    self._move("RUNNING", rec)
            elif event == "recovered":
                self._fields["step"] = rec.get("step")
            elif event == "exit":
                code = int(rec.get("code") or 0)
                self._fields["exit_code"] = code
                self._move("COMPLETED" if code == 0 else "FULL_RESTART" if code == _FULL_RESTART_EXIT else "FAILED",
                           rec)

    def _move(self, state: str, rec: dict[str, Any]) -> None:
        self._state = state
        self._since = float(rec.get("time") or time.time())
        self._transitions[state] = round(self._since, 6)

    def snapshot(self) -> dict[str, Any]:
        """The ``/status`` document: ``state``, ``generation``, ``restart_count`` (the job-wide
        generation: every process restart, in-process restart and membership change moves it, as
        ``JOB_RESTART_COUNT`` in the workers), ``restarts`` (what this agent did, by kind),
        ``transitions`` (state -> when it was last entered), and the node's place in the job."""
        with self._lock:
            return {"state": self._state, "since": round(self._since, 6), "generation": self._generation,
                    "restart_count": self._generation, "restarts": dict(self._restarts),
                    "transitions": dict(self._transitions), **self._fields}

    @property
    def state(self) -> str:
        with self._lock:
            return self._state


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        status = self.server.status.snapshot()
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        if path == "/health":
            failed = status["state"] == "FAILED"
            self._reply(503 if failed else 200, {"healthy": not failed, "state": status["state"]})
        elif path == "/status":
            self._reply(200, status)
        elif path == "/restart_count":
            self._reply(200, {"restart_count": status["restart_count"]})
        else:
            self._reply(404, {"error": f"no such path {path}; try /health, /status or /restart_count"})

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body, default=str).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass  # probes every few seconds would drown the agent's own lines


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], status: AgentStatus) -> None:
        self.status = status
        super().__init__(address, _Handler)


class AgentApi:
    """The running HTTP server; ``address`` is where it listens (the port chosen when 0 was given)."""

    def __init__(self, server: _Server) -> None:
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="tierckpt-agent-api", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, settings: ApiSettings, status: AgentStatus) -> AgentApi | None:
        """Listen on ``settings`` (None when no port was given). A port that cannot be bound is a
        ``ConfigError`` naming it and the fix (``cli`` checks it before any worker starts too)."""
        if settings.port is None:
            return None
        try:
            return cls(_Server((settings.host, settings.port), status))
        except OSError as exc:
            raise ConfigError(f"--server-port {settings.port} on {settings.host}: cannot listen ({exc.strerror or exc}); "
                              "pick a free port, or 0 for any") from None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
