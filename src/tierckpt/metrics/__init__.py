"""Prometheus metrics for the library, ``tierckpt run`` and ``tierckpt agent``.

    import tierckpt.metrics
    tierckpt.metrics.enable(port=9402)       # the library's metrics at http://127.0.0.1:9402/metrics
    # or: TIERCKPT_METRICS_PORT=9402 (each rank serves on 9402 + LOCAL_RANK)

``core`` holds the value types and the endpoint (``Registry``, ``Counter``, ``Gauge``,
``Histogram``, ``serve``), which the launcher and the agent use for their own registries;
``library`` holds the Checkpointer's metrics and the hooks the library calls. Every metric
and label is listed in docs/metrics.md.
"""

from __future__ import annotations

from tierckpt.metrics.core import (
    DEFAULT_BUCKETS,
    Counter,
    Gauge,
    Histogram,
    MetricsServer,
    Registry,
    serve,
)
from tierckpt.metrics.library import (
    LibraryMetrics,
    dcp_committed,
    dcp_failed,
    dcp_loaded,
    dcp_written,
    disable,
    durable_committed,
    durable_failed,
    durable_retry,
    enable,
    enable_from_env,
    library_metrics,
    loaded,
    memory_committed,
    memory_fallback,
    save_failed,
    save_staged,
    server,
)

__all__ = [
    "DEFAULT_BUCKETS",
    "Counter",
    "Gauge",
    "Histogram",
    "LibraryMetrics",
    "MetricsServer",
    "Registry",
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
    "serve",
    "server",
]
