"""The library's own metrics: what ``Checkpointer`` saves, drains and loads, off until enabled.

    import tierckpt.metrics
    tierckpt.metrics.enable(port=9402)      # or TIERCKPT_METRICS_PORT=9402 in the environment

Call order: ``enable`` (or ``enable_from_env``, which ``Checkpointer.__init__`` calls) creates
the metrics once per process and optionally serves them; the hooks below are called by the
library (one line at each site) from the training thread and its committer and drain threads.
Until ``enable`` is called every hook returns after one global lookup, so the library pays
nothing for metrics it does not export.

With ``TIERCKPT_METRICS_PORT=P`` each process serves on ``P + LOCAL_RANK`` (one endpoint per
rank on a node, no port clash); ``TIERCKPT_METRICS_HOST`` (default 127.0.0.1) is the bind address.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.metrics.core import MetricsServer, Registry, serve

__all__ = [
    "LibraryMetrics",
    "dcp_committed",
    "dcp_failed",
    "dcp_loaded",
    "dcp_written",
    "disable",
    "durable_committed",
    "durable_failed",
    "durable_retry",
    "enable",
    "enable_from_env",
    "library_metrics",
    "loaded",
    "memory_committed",
    "memory_fallback",
    "save_failed",
    "save_staged",
    "server",
]

_log = logging.getLogger("tierckpt.metrics")
#: load tiers from fastest to slowest; a load is labelled with the slowest tier it read from
_TIER_ORDER = ("memory", "peer", "durable")


@dataclass
class _Lag:
    pending: list[tuple[int, float]] = field(default_factory=list)  # memory commits not yet durable
    durable_step: int | None = None


class LibraryMetrics:
    """The metric objects and the drain-lag bookkeeping of one process."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        ns, nt = ("namespace",), ("namespace", "tier")
        self.blocking = r.histogram("tierckpt_save_blocking_seconds",
                                    "Seconds Checkpointer.save blocked the training loop (the copy into shared memory)", ns)
        self.commit = r.histogram("tierckpt_save_commit_seconds",
                                  "Seconds from the end of staging to the commit, by tier (memory: in the background "
                                  "after staging; durable: the drain itself)", nt)
        self.saves = r.counter("tierckpt_saves_total", "Steps committed, by tier", nt)
        self.bytes = r.counter("tierckpt_save_bytes_total", "Bytes committed by this rank, by tier", nt)
        self.failures = r.counter("tierckpt_save_failures_total", "Saves that failed, by tier", nt)
        self.fallbacks = r.counter("tierckpt_memory_fallback_total",
                                   "Saves written straight to the durable tier because the memory tier failed, by cause "
                                   "(no_space, unwritable, error)", ("namespace", "cause"))
        self.retries = r.counter("tierckpt_durable_retries_total",
                                 "Durable-tier requests tried again after a transient failure", ("operation",))
        self.last_step = r.gauge("tierckpt_last_committed_step", "Newest step committed, by tier", nt)
        self.lag_steps = r.gauge("tierckpt_drain_lag_steps",
                                 "Training steps between the newest memory commit and the newest durable one", ns)
        self.lag_seconds = r.gauge("tierckpt_drain_lag_seconds",
                                   "Age of the oldest memory commit that has no durable copy yet (0: caught up)", ns)
        self.load_seconds = r.histogram("tierckpt_load_seconds",
                                        "Seconds Checkpointer.load took, by the slowest tier it read from", nt)
        self.loads = r.counter("tierckpt_loads_total", "Checkpoint loads, by the slowest tier read from", nt)
        self.last_loaded = r.gauge("tierckpt_last_loaded_step", "Step restored by the last load", ns)
        self._lock = threading.Lock()
        self._lag: dict[str, _Lag] = {}
        self._staged: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
        r.on_collect(self._refresh_lag)

    def staged(self, handle: Any) -> None:
        with self._lock:
            self._staged[handle] = time.perf_counter()

    def since_staged(self, handle: Any) -> float | None:
        with self._lock:
            t0 = self._staged.pop(handle, None)
        return None if t0 is None else time.perf_counter() - t0

    def memory_step(self, namespace: str, step: int) -> None:
        with self._lock:
            self._lag.setdefault(namespace, _Lag()).pending.append((step, time.monotonic()))

    def durable_step(self, namespace: str, step: int) -> None:
        with self._lock:
            lag = self._lag.setdefault(namespace, _Lag())
            lag.durable_step = step if lag.durable_step is None else max(lag.durable_step, step)
            lag.pending = [(s, t) for s, t in lag.pending if s > lag.durable_step]

    def _refresh_lag(self) -> None:
        now = time.monotonic()
        with self._lock:
            items = [(ns, list(lag.pending), lag.durable_step) for ns, lag in self._lag.items()]
        for ns, pending, durable in items:
            if not pending:
                self.lag_steps.set(0, namespace=ns)
                self.lag_seconds.set(0, namespace=ns)
                continue
            base = durable if durable is not None else min(s for s, _ in pending)
            self.lag_steps.set(max(s for s, _ in pending) - base, namespace=ns)
            self.lag_seconds.set(now - min(t for _, t in pending), namespace=ns)


_METRICS: LibraryMetrics | None = None
_SERVER: MetricsServer | None = None
_STATE_LOCK = threading.Lock()


def library_metrics() -> LibraryMetrics | None:
    """This process's library metrics, or None while they are off."""
    return _METRICS


def enable(port: int | None = None, *, host: str | None = None) -> LibraryMetrics:
    """Turn the library's metrics on (idempotent); with ``port``, serve them at ``host:port/metrics``
    (``host``: ``$TIERCKPT_METRICS_HOST``, else 127.0.0.1).

    Port 0 picks a free port (``tierckpt.metrics.server().port``). A second call with a port
    while one is served keeps the first server.
    """
    global _METRICS, _SERVER
    with _STATE_LOCK:
        if _METRICS is None:
            _METRICS = LibraryMetrics()
        if port is not None and _SERVER is None:
            _SERVER = serve(_METRICS.registry, port, host)
            _log.info("serving tierckpt metrics on http://%s:%d/metrics", _SERVER.host, _SERVER.port)
        return _METRICS


def server() -> MetricsServer | None:
    """The endpoint ``enable`` started, if any."""
    return _SERVER


def disable() -> None:
    """Stop serving and drop the metrics (the hooks go quiet again)."""
    global _METRICS, _SERVER
    with _STATE_LOCK:
        if _SERVER is not None:
            _SERVER.close()
        _METRICS, _SERVER = None, None


def enable_from_env() -> None:
    """``TIERCKPT_METRICS_PORT`` set: enable and serve on it plus ``LOCAL_RANK``.

    Metrics never stop training: a port in use or a missing prometheus_client is logged, not raised.
    """
    raw = os.environ.get("TIERCKPT_METRICS_PORT")
    if not raw or _SERVER is not None:
        return
    try:
        port = int(raw) + int(os.environ.get("LOCAL_RANK", "0") or 0)
        if int(raw) < 0 or port > 65535:
            raise ValueError(raw)
    except ValueError:
        _log.warning("TIERCKPT_METRICS_PORT=%r is not a port number; metrics stay off", raw)
        return
    try:
        enable(port)
    except (OSError, ConfigError) as exc:
        _log.warning("cannot serve tierckpt metrics on port %d: %s; training goes on without them", port, exc)


# -- hooks: one line each in the library; all return at once while metrics are off ----------------


def save_staged(ck: Any, handle: Any, nbytes: int) -> None:
    """``Checkpointer.save`` copied a step into shared memory (``handle.blocking_s`` seconds)."""
    m = _METRICS
    if m is None:
        return
    m.blocking.observe(handle.blocking_s, namespace=ck.config.namespace)
    m.bytes.inc(nbytes, namespace=ck.config.namespace, tier="memory")
    m.staged(handle)


def memory_committed(ck: Any, handle: Any) -> None:
    """The background committer made ``handle.step`` visible in the memory tier."""
    m = _METRICS
    if m is None:
        return
    ns = ck.config.namespace
    dt = m.since_staged(handle)
    if dt is not None:
        m.commit.observe(dt, namespace=ns, tier="memory")
    m.saves.inc(namespace=ns, tier="memory")
    m.last_step.set(handle.step, namespace=ns, tier="memory")
    if ck.config.durable_url is not None:
        m.memory_step(ns, handle.step)


def save_failed(ck: Any, handle: Any) -> None:
    """The memory commit of ``handle.step`` failed."""
    m = _METRICS
    if m is None:
        return
    m.since_staged(handle)
    m.failures.inc(namespace=ck.config.namespace, tier="memory")


def durable_committed(ck: Any, step: int, nbytes: int, seconds: float) -> None:
    """A drain committed ``step`` to the durable tier (``nbytes``: this rank's share)."""
    m = _METRICS
    if m is None:
        return
    ns = ck.config.namespace
    m.commit.observe(seconds, namespace=ns, tier="durable")
    m.saves.inc(namespace=ns, tier="durable")
    m.bytes.inc(nbytes, namespace=ns, tier="durable")
    m.last_step.set(step, namespace=ns, tier="durable")
    m.durable_step(ns, step)


def durable_failed(ck: Any, step: int) -> None:
    """A drain of ``step`` failed (its memory copy is intact)."""
    m = _METRICS
    if m is None:
        return
    m.failures.inc(namespace=ck.config.namespace, tier="durable")


def memory_fallback(ck: Any, cause: str) -> None:
    """The memory tier failed (``cause``): a save goes straight to the durable tier."""
    m = _METRICS
    if m is None:
        return
    m.fallbacks.inc(namespace=ck.config.namespace, cause=cause)


def durable_retry(operation: str) -> None:
    """A durable-tier request (``operation``: e.g. put, get, list) is tried again."""
    m = _METRICS
    if m is None:
        return
    m.retries.inc(operation=operation)


def loaded(ck: Any) -> None:
    """``Checkpointer.load`` restored ``ck.last_load['step']`` (its dict: step, seconds, tiers)."""
    m = _METRICS
    if m is None:
        return
    info = ck.last_load
    used = [t for t in _TIER_ORDER if t in info.get("tiers", ())] or list(info.get("tiers", ())) or ["none"]
    tier = used[-1]
    ns = ck.config.namespace
    m.load_seconds.observe(float(info.get("seconds", 0.0)), namespace=ns, tier=tier)
    m.loads.inc(namespace=ns, tier=tier)
    if info.get("step") is not None:
        m.last_loaded.set(info["step"], namespace=ns)


# -- the DCP plug-ins' hooks (TieredStorageWriter / TieredStorageReader, and so every integration
# built on them: Lightning, torchtitan, Ray, the SageMaker-compatible API, plain dcp.save/load) ----


def dcp_written(namespace: str, tier: str, nbytes: int) -> None:
    """A ``TieredStorageWriter`` put this rank's ``nbytes`` of a step into ``tier``."""
    m = _METRICS
    if m is None:
        return
    m.bytes.inc(nbytes, namespace=namespace, tier=tier)


def dcp_committed(namespace: str, tier: str, step: int, seconds: float) -> None:
    """The coordinator committed ``step`` in ``tier``, ``seconds`` after its ``write_data`` began."""
    m = _METRICS
    if m is None:
        return
    m.commit.observe(seconds, namespace=namespace, tier=tier)
    m.saves.inc(namespace=namespace, tier=tier)
    m.last_step.set(step, namespace=namespace, tier=tier)
    if tier == "durable":
        m.durable_step(namespace, step)


def dcp_failed(namespace: str, tier: str) -> None:
    """A ``TieredStorageWriter`` save failed in ``tier``."""
    m = _METRICS
    if m is None:
        return
    m.failures.inc(namespace=namespace, tier=tier)


def dcp_loaded(namespace: str, step: int | None, seconds: float, tiers: Any) -> None:
    """A ``TieredStorageReader`` read this rank's share of ``step`` from ``tiers`` (names)."""
    m = _METRICS
    if m is None:
        return
    names = set(tiers)
    used = [t for t in _TIER_ORDER if t in names] or sorted(names) or ["none"]
    m.load_seconds.observe(seconds, namespace=namespace, tier=used[-1])
    m.loads.inc(namespace=namespace, tier=used[-1])
    if step is not None:
        m.last_loaded.set(step, namespace=namespace)
