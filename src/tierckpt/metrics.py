"""Prometheus metrics without a dependency: counters and gauges, text format, an HTTP endpoint.

    reg = Registry()
    faults = reg.counter("tierckpt_run_faults_total", "Faults detected", ("reason",))
    faults.inc(reason="Crash")
    gen = reg.gauge("tierckpt_run_generation", "Current restart generation")
    gen.set(3)
    server = serve(reg, port=9400)      # GET /metrics -> text format 0.0.4; server.close()

Names and labels follow the Prometheus conventions (``_total`` for counters, base units
such as ``_seconds`` and ``_bytes``). The server binds 127.0.0.1 unless told otherwise.
Each process owns its own Registry (no module-level state).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["Counter", "Gauge", "MetricsServer", "Registry", "serve"]


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    v = float(value)
    return str(int(v)) if v.is_integer() and abs(v) < 1e15 else repr(v)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, labels: Iterable[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labels = tuple(labels)
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()
        if not self.labels:
            self._values[()] = 0.0

    def _key(self, labels: dict[str, object]) -> tuple[str, ...]:
        if set(labels) != set(self.labels):
            raise ValueError(f"metric {self.name} takes labels {self.labels}, got {tuple(labels)}")
        return tuple(str(labels[k]) for k in self.labels)

    def value(self, **labels: object) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        with self._lock:
            items = sorted(self._values.items())
        for key, v in items:
            if key:
                pairs = ",".join(f'{k}="{_escape(x)}"' for k, x in zip(self.labels, key, strict=True))
                lines.append(f"{self.name}{{{pairs}}} {_fmt(v)}")
            else:
                lines.append(f"{self.name} {_fmt(v)}")
        return lines


class Counter(_Metric):
    """A monotonically increasing count."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount


class Gauge(_Metric):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, value: float, **labels: object) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount


class Registry:
    """The metrics of one process, rendered in registration order."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}
        self._lock = threading.Lock()

    def _add(self, metric: _Metric) -> _Metric:
        with self._lock:
            if metric.name in self._metrics:
                raise ValueError(f"metric {metric.name} is already registered")
            self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help_text: str, labels: Iterable[str] = ()) -> Counter:
        m = self._add(Counter(name, help_text, labels))
        assert isinstance(m, Counter)
        return m

    def gauge(self, name: str, help_text: str, labels: Iterable[str] = ()) -> Gauge:
        m = self._add(Gauge(name, help_text, labels))
        assert isinstance(m, Gauge)
        return m

    def render(self) -> str:
        with self._lock:
            metrics = list(self._metrics.values())
        return "\n".join(line for m in metrics for line in m.render()) + "\n"


class MetricsServer:
    """A thread serving ``GET /metrics``; ``close()`` stops it and frees the port."""

    def __init__(self, registry: Registry, port: int, host: str = "127.0.0.1") -> None:
        reg = registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                body = reg.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
                return

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="tierckpt-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve(registry: Registry, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` on ``host:port`` (port 0 picks a free one; see ``.port``)."""
    return MetricsServer(registry, port, host)
