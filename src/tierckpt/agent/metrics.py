"""The agent's Prometheus metrics (served by ``tierckpt.metrics.serve`` when asked) and the loads' waits (``status``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from tierckpt.metrics import Registry

__all__ = ["AgentMetrics", "LoadWaits", "union_seconds"]


class AgentMetrics:
    """One registry per agent: bytes held, replication and drain progress, evictions, rejects."""

    def __init__(self) -> None:
        self.registry = r = Registry()
        self.held_bytes = r.gauge("tierckpt_agent_held_bytes", "Bytes of committed copies on this node", ("kind",))
        self.replicated_bytes = r.counter("tierckpt_agent_replicated_bytes_total", "Bytes sent to peers as replicas")
        self.replication_seconds = r.gauge("tierckpt_agent_replication_seconds", "Duration of the last replication")
        self.replication_throughput = r.gauge("tierckpt_agent_replication_bytes_per_second",
                                              "Throughput of the last replication (bytes/s)")
        self.replication_lag = r.gauge("tierckpt_agent_replication_lag_namespaces",
                                       "Namespaces whose newest step is not replicated yet")
        self.replication_lag_seconds = r.gauge("tierckpt_agent_replication_lag_seconds",
                                               "Age of the oldest newest-step that is not replicated yet (0: none)")
        self.replication_failures = r.counter("tierckpt_agent_replication_failures_total", "Failed replications")
        self.replicas_rejected = r.counter("tierckpt_agent_replicas_rejected_total", "Received replicas that failed verification")
        self.fetched_bytes = r.counter("tierckpt_agent_fetched_bytes_total", "Bytes fetched from peers for loads")
        self.fetch_seconds = r.counter("tierckpt_agent_fetch_seconds_total", "Seconds spent fetching files for loads")
        self.evictions = r.counter("tierckpt_agent_evictions_total", "Copies evicted by the node budget", ("kind",))
        self.rejected = r.counter("tierckpt_agent_rejected_connections_total", "Peer connections closed for a protocol violation")
        self.insecure_wire = r.gauge("tierckpt_agent_insecure_wire",
                                     "1 when peers talk without TLS (--insecure-wire), else 0")
        self.drain_lag = r.gauge("tierckpt_agent_drain_lag_steps",
                                 "Committed memory steps newer than the newest durable step, all namespaces")


def union_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``(start, end)`` intervals (a load's requests overlap)."""
    total, reach = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > reach:
            total += hi - max(lo, reach)
            reach = hi
    return total


class LoadWaits:
    """How long the loads' ``fetch`` requests waited on this agent (the network, or a prefetch in
    flight), per ``<ns>/step_<N>``: the union of the requests' intervals, the number of requests and
    the slowest file. The newest ``kept`` steps are kept, at most ``per_step`` requests each."""

    def __init__(self, kept: int = 16, per_step: int = 256) -> None:
        self.kept, self.per_step = kept, per_step
        self._steps: dict[str, list[tuple[float, float, str]]] = {}
        self._lock = threading.Lock()

    def note(self, key: str, name: str, start: float, end: float) -> None:
        with self._lock:
            spans = self._steps.pop(key, [])
            if len(spans) < self.per_step:
                spans.append((start, end, name))
            self._steps[key] = spans
            while len(self._steps) > self.kept:
                del self._steps[next(iter(self._steps))]

    def view(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            items = [(k, list(v)) for k, v in self._steps.items()]
        out = {}
        for key, spans in items:
            slowest = max(spans, key=lambda s: s[1] - s[0])
            out[key] = {"seconds": round(union_seconds([(a, b) for a, b, _ in spans]), 4), "files": len(spans),
                        "slowest": slowest[2], "slowest_s": round(slowest[1] - slowest[0], 4)}
        return out
