"""What a user of ``tierckpt run`` sees: JSON-lines events, Prometheus metrics, log lines.

    ev = Events(path="events.jsonl", node=0, metrics_port=9400, host="trn-17")
    ev.emit("fault", generation=3, reason="Hang", rank=1, detail="...")
    ev.close()

One JSON object per line, flushed at once: ``event`` (``started``, ``fault``, ``stopped``,
``restart``, ``exit``, ``timeout``, ``warning``), ``time`` (Unix seconds), ``generation``,
``node`` (the node's index, its group rank; events before the first rendezvous are held back
and written once it is known, so every line has it; None only if the agent never joined), ``host``
(its hostname), and the event's own fields (a fault: ``reason``, ``rank``; a restart: ``kind``
``process`` or ``job``; an exit: ``code``). Each event also goes to the ``tierckpt.run`` logger
and updates the metrics.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from tierckpt.metrics import MetricsServer, Registry, serve

__all__ = ["Events", "describe_error"]

log = logging.getLogger("tierckpt.run")


class Events:
    """The event sink of one agent (node)."""

    def __init__(self, path: str | None, node: int | None, metrics_port: int | None = None, *,
                 host: str | None = None) -> None:
        self._node = node
        self._held: list[dict[str, Any]] = []  # emitted before the node's index was known
        self.host = host
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        reg = self.registry = Registry()
        self.faults = reg.counter("tierckpt_run_faults_total", "Faults detected, by reason", ("reason",))
        self.restarts = reg.counter("tierckpt_run_restarts_total",
                                    "Restarts, by kind (process, inprocess, replace, or job: a full job restart)",
                                    ("kind",))
        self.downtime = reg.counter("tierckpt_run_downtime_seconds_total",
                                    "Seconds without training after faults: from the fault's last sign of life to the "
                                    "first step of every local rank (all kinds of restart, full job restarts included)")
        self.detection = reg.gauge("tierckpt_run_last_detection_latency_seconds",
                                   "From the fault's last sign of life to its detection")
        self.recovery = reg.gauge("tierckpt_run_last_recovery_seconds",
                                  "From detection to the first step (heartbeat) of every local rank of the next generation")
        self.generation = reg.gauge("tierckpt_run_generation", "Current restart generation (job-wide)")
        self.step = reg.gauge("tierckpt_run_newest_step", "Newest training step reported by a heartbeat")
        self.hb_timeout = reg.gauge("tierckpt_run_heartbeat_timeout_seconds", "Current hang timeout")
        # the HyperPod operator's job counters and latency histograms (docs/metrics.md)
        self.detection_h = reg.histogram("tierckpt_run_detection_latency_seconds",
                                         "Time to detect: from the fault's last sign of life to its detection, by reason",
                                         ("reason",))
        self.recovery_h = reg.histogram("tierckpt_run_recovery_seconds",
                                        "Time to recover: from detection to the first step of every local rank "
                                        "(inprocess: until every local rank restarted in its process), by kind",
                                        ("kind",))
        self.downtime_h = reg.histogram("tierckpt_run_downtime_seconds",
                                        "Downtime of one fault: time to detect plus time to recover, by kind of restart",
                                        ("kind",))
        self.jobs_started = reg.counter("tierckpt_run_jobs_started_total",
                                        "Job incarnations this agent started workers for (a full job restart starts one)")
        self.jobs_ended = reg.counter("tierckpt_run_jobs_ended_total",
                                      "Job incarnations this agent ended, by outcome (succeeded, failed, full_restart)",
                                      ("outcome",))
        # the node health monitor (detect/healthwatch.py) and the drains it caused (supervisor/draining.py)
        self.healthy = reg.gauge("tierckpt_run_node_healthy", "1 while this node's health checks pass, 0 while one "
                                 "failed --health-fail-after rounds in a row")
        self.health_failures = reg.counter("tierckpt_run_health_failures_total",
                                           "Health checks that turned the node unhealthy, by check", ("check",))
        self.drains = reg.counter("tierckpt_run_drains_total",
                                  "Unhealthy nodes that left the job for a waiting spare (no fault, no restart counted)")
        self.healthy.set(1)
        self._last_detection: float = 0.0  # the newest fault's detection latency (its downtime's first part)
        self.server: MetricsServer | None = None
        if metrics_port is not None:
            self.server = serve(reg, metrics_port, host=os.environ.get("TIERCKPT_METRICS_HOST", "127.0.0.1"))

    def listen(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call ``fn(record)`` after each event is written (the agent API's status, agentapi.py)."""
        self._listeners.append(fn)

    @property
    def node(self) -> int | None:
        return self._node

    @node.setter
    def node(self, value: int | None) -> None:
        """Set once the rendezvous gave this node its index; writes the events held until then."""
        with self._lock:
            self._node = value
            if value is not None:
                held, self._held = self._held, []
                for rec in held:
                    rec["node"] = value
                    self._write(rec)

    def _write(self, rec: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(rec, default=str) + "\n")

    def emit(self, event: str, *, generation: int, **fields: Any) -> dict[str, Any]:
        rec: dict[str, Any] = {"event": event, "time": round(time.time(), 6), "generation": generation,
                               "node": self.node, "host": self.host}
        rec.update(fields)
        self.generation.set(generation)
        self._measure(event, fields)
        with self._lock:
            if self._node is None and event != "spare":  # a spare's stand-by is news before any rank is known
                self._held.append(rec)
            else:
                self._write(rec)
        for fn in self._listeners:
            fn(rec)
        level = logging.WARNING if event in ("fault", "warning") else logging.INFO
        log.log(level, "[Node %s] Generation %s: %s %s", self.node, generation, event,
                " ".join(f"{k}={v}" for k, v in fields.items()))
        return rec

    def _measure(self, event: str, fields: dict[str, Any]) -> None:
        """The metrics an event moves. Downtime is counted once per fault: at ``recovered`` (a
        process restart, a one-rank replacement, a full job restart's next incarnation: the event's
        ``kind``) or at an in-process ``restart`` (its ``recovery_s``; no ``recovered`` follows)."""
        if event == "fault":
            self.faults.inc(reason=str(fields.get("reason")))
            latency = fields.get("detection_latency_s")
            self._last_detection = float(latency) if isinstance(latency, (int, float)) else 0.0
            if isinstance(latency, (int, float)):
                self.detection_h.observe(float(latency), reason=str(fields.get("reason")))
        elif event == "restart":
            kind = str(fields.get("kind"))
            self.restarts.inc(kind=kind)
            if kind == "inprocess" and isinstance(fields.get("recovery_s"), (int, float)):
                self._recovered(kind, float(fields["recovery_s"]))
        elif event == "recovered" and isinstance(fields.get("recovery_s"), (int, float)):
            self._recovered(str(fields.get("kind") or "process"), float(fields["recovery_s"]))
        elif event == "health":
            if isinstance(fields.get("healthy"), bool):
                self.healthy.set(1 if fields["healthy"] else 0)
            if fields.get("status") == "unhealthy":
                self.health_failures.inc(check=str(fields.get("check")))
        elif event == "drain" and fields.get("state") == "left":
            self.drains.inc()
        elif event == "started":
            self.jobs_started.inc()
        elif event == "exit":
            code = fields.get("code")
            self.jobs_ended.inc(outcome="succeeded" if code == 0 else "full_restart" if code == 75 else "failed")

    def _recovered(self, kind: str, recovery_s: float) -> None:
        down = recovery_s + self._last_detection
        self._last_detection = 0.0
        self.recovery.set(recovery_s)
        self.recovery_h.observe(recovery_s, kind=kind)
        self.downtime_h.observe(down, kind=kind)
        self.downtime.inc(down)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        with self._lock:
            for rec in self._held:  # never joined: written without an index
                self._write(rec)
            self._held = []
            if self._file is not None:
                self._file.close()
                self._file = None


def describe_error(exc: BaseException) -> str:
    """``Type: first line of the message (at tierckpt/module.py:LINE in function)``: one line that
    names an unexpected error and the innermost tierckpt frame it came from."""
    import traceback

    text = str(exc).splitlines()[0] if str(exc) else ""
    where = ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        parts = frame.filename.split(os.sep)
        if "tierckpt" in parts[:-1]:
            path = "/".join(parts[len(parts) - 1 - parts[::-1].index("tierckpt"):])
            where = f" (at {path}:{frame.lineno} in {frame.name})"
            break
    return f"{type(exc).__name__}: {text}{where}" if text else f"{type(exc).__name__}{where}"
