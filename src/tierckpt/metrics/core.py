"""Metric values and their exposition: counters, gauges, histograms, a registry, an HTTP endpoint.

    reg = Registry()
    faults = reg.counter("tierckpt_run_faults_total", "Faults detected", ("reason",))
    faults.inc(reason="Crash")
    gen = reg.gauge("tierckpt_run_generation", "Current restart generation")
    gen.set(3)
    server = serve(reg, port=9400)      # GET /metrics; server.port; server.close()

Recording is dependency-free and takes one lock per call, so a component can own a Registry
whether or not anyone scrapes it. Exposition is ``prometheus_client``'s (``pip install
'tierckpt[metrics]'``): a Registry is a prometheus_client collector (``collect()`` yields its
metric families), and ``serve`` runs prometheus_client's HTTP server on a registry of its own
holding this Registry, plus the process collector (CPU, RSS, open files). Names and labels
follow the Prometheus conventions (``_total`` counters, base units ``_seconds``/``_bytes``).
The server binds ``$TIERCKPT_METRICS_HOST``, else 127.0.0.1, unless told otherwise.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from tierckpt.errors import ConfigError

__all__ = ["DEFAULT_BUCKETS", "Counter", "Gauge", "Histogram", "MetricsServer", "Registry", "serve"]

#: seconds, from a sub-millisecond memory save to a many-minute durable drain
DEFAULT_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)


def _prometheus() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core  # noqa: F401 - the MetricFamily classes
    except ImportError as exc:
        raise ConfigError(
            "serving metrics needs prometheus_client: pip install 'tierckpt[metrics]'"
        ) from exc
    return prometheus_client


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, labels: Iterable[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labels = tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, object]) -> tuple[str, ...]:
        if len(labels) != len(self.labels) or set(labels) != set(self.labels):
            raise ValueError(f"metric {self.name} takes labels {self.labels}, got {tuple(labels)}")
        return tuple(str(labels[k]) for k in self.labels)

    def family(self) -> Any:  # a prometheus_client MetricFamily
        raise NotImplementedError


class _Scalar(_Metric):
    def __init__(self, name: str, help_text: str, labels: Iterable[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[tuple[str, ...], float] = {} if self.labels else {(): 0.0}

    def value(self, **labels: object) -> float:
        key = self._key(labels)
        with self._lock:
            return self._values.get(key, 0.0)

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def samples(self) -> list[tuple[tuple[str, ...], float]]:
        with self._lock:
            return sorted(self._values.items())


class Counter(_Scalar):
    """A monotonically increasing count."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        super().inc(amount, **labels)

    def family(self) -> Any:
        fam = _prometheus().core.CounterMetricFamily(self.name, self.help, labels=self.labels)
        for key, v in self.samples():
            fam.add_metric(list(key), v)
        return fam


class Gauge(_Scalar):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, value: float, **labels: object) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def remove(self, **labels: object) -> None:
        key = self._key(labels)
        with self._lock:
            self._values.pop(key, None)

    def family(self) -> Any:
        fam = _prometheus().core.GaugeMetricFamily(self.name, self.help, labels=self.labels)
        for key, v in self.samples():
            fam.add_metric(list(key), v)
        return fam


class Histogram(_Metric):
    """Observations counted into cumulative buckets (upper bounds ``buckets``, then +Inf)."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, labels: Iterable[str] = (),
                 buckets: Sequence[float] = DEFAULT_BUCKETS) -> None:
        super().__init__(name, help_text, labels)
        self.buckets = tuple(sorted(float(b) for b in buckets))
        # per label set: counts per bucket (last = +Inf), sum
        self._data: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, value: float, **labels: object) -> None:
        key = self._key(labels)
        i = bisect.bisect_left(self.buckets, value)
        with self._lock:
            counts, total = self._data.setdefault(key, ([0] * (len(self.buckets) + 1), [0.0]))
            counts[i] += 1
            total[0] += value

    def count(self, **labels: object) -> int:
        key = self._key(labels)
        with self._lock:
            entry = self._data.get(key)
            return sum(entry[0]) if entry else 0

    def sum(self, **labels: object) -> float:
        key = self._key(labels)
        with self._lock:
            entry = self._data.get(key)
            return entry[1][0] if entry else 0.0

    def family(self) -> Any:
        fam = _prometheus().core.HistogramMetricFamily(self.name, self.help, labels=self.labels)
        with self._lock:
            items = sorted((k, (list(c), t[0])) for k, (c, t) in self._data.items())
        bounds = [repr(b) for b in self.buckets] + ["+Inf"]
        for key, (counts, total) in items:
            cumulative, running = [], 0
            for bound, c in zip(bounds, counts, strict=True):
                running += c
                cumulative.append((bound, running))
            fam.add_metric(list(key), buckets=cumulative, sum_value=total)
        return fam


class Registry:
    """The metrics of one component, exposed in registration order.

    ``on_collect(fn)`` registers a function run before each exposition, for values that
    are a function of time (e.g. how long the durable tier has been behind).
    """

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}
        self._refresh: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def _add(self, metric: _Metric) -> None:
        with self._lock:
            if metric.name in self._metrics:
                raise ValueError(f"metric {metric.name} is already registered")
            self._metrics[metric.name] = metric

    def counter(self, name: str, help_text: str, labels: Iterable[str] = ()) -> Counter:
        m = Counter(name, help_text, labels)
        self._add(m)
        return m

    def gauge(self, name: str, help_text: str, labels: Iterable[str] = ()) -> Gauge:
        m = Gauge(name, help_text, labels)
        self._add(m)
        return m

    def histogram(self, name: str, help_text: str, labels: Iterable[str] = (),
                  buckets: Sequence[float] = DEFAULT_BUCKETS) -> Histogram:
        m = Histogram(name, help_text, labels, buckets)
        self._add(m)
        return m

    def on_collect(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._refresh.append(fn)

    def names(self) -> list[str]:
        """The metric names, as a scraper sees them (a counter keeps its ``_total``)."""
        with self._lock:
            return list(self._metrics)

    def collect(self) -> Iterator[Any]:
        """The prometheus_client collector protocol: one MetricFamily per metric."""
        with self._lock:
            refresh, metrics = list(self._refresh), list(self._metrics.values())
        for fn in refresh:
            fn()
        for m in metrics:
            yield m.family()

    def render(self) -> str:
        """The text exposition format (what ``GET /metrics`` returns)."""
        prom = _prometheus()
        holder = prom.CollectorRegistry(auto_describe=False)
        holder.register(self)
        return str(prom.generate_latest(holder).decode())


class MetricsServer:
    """prometheus_client's HTTP server in a thread; ``close()`` stops it and frees the port."""

    def __init__(self, registries: Sequence[Registry], port: int, host: str = "127.0.0.1") -> None:
        prom = _prometheus()
        holder = prom.CollectorRegistry(auto_describe=False)
        for reg in registries:
            holder.register(reg)
        holder.register(prom.ProcessCollector(registry=None))
        self._httpd, self._thread = prom.start_http_server(port, addr=host, registry=holder)
        self.host = host
        self.port = int(self._httpd.server_address[1])

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve(registry: Registry | Sequence[Registry], port: int, host: str | None = None) -> MetricsServer:
    """Serve ``registry`` (or several) on ``host:port`` (port 0 picks a free one; see ``.port``).

    ``host`` defaults to ``$TIERCKPT_METRICS_HOST``, else 127.0.0.1: the launcher, the agent
    and the library bind alike, and a pod sets 0.0.0.0 once for all three to be scraped.
    """
    regs = [registry] if isinstance(registry, Registry) else list(registry)
    return MetricsServer(regs, port, host or os.environ.get("TIERCKPT_METRICS_HOST", "127.0.0.1"))
