"""The agent's Prometheus metrics (served by ``tierckpt.metrics.serve`` when asked)."""

from __future__ import annotations

from tierckpt.metrics import Registry

__all__ = ["AgentMetrics"]


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
