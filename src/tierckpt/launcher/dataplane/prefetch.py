"""The launcher's half of prefetch on join (``tierckpt.agent.prefetch``): tell the hosted node agent
which ranks this node runs as soon as the rendezvous assigned them, before the workers start.

Call order (``TierckptAgent``): ``_join`` (rendezvous, rank assignment) → the hosted agent is up
and knows its peers (``_discover_peers``) → ``start(...)`` → the workers start. The agent pulls
the newest state of these ranks that the peers hold (nothing when this node's own memory holds
it, as on a survivor) while the workers import and build the model; their load finds the files
cached or waits for the one in flight. Events: ``prefetch`` with ``phase`` ``started`` (before
the workers start: its ``time`` precedes every load) and ``done`` (what was fetched, bytes and
seconds); a failure is a ``warning`` and the load fetches for itself as before.

``TIERCKPT_PREFETCH=0`` turns it off (the benchmark's baseline).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tierckpt.launcher.events import Events

__all__ = ["ENV", "enabled", "start"]

ENV = "TIERCKPT_PREFETCH"


def enabled(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    return (os.environ if env is None else env).get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def start(node_agent: Any, namespace: str | None, ranks: Sequence[int], events: Events, generation: int) -> Any:
    """Start the hosted agent's prefetch of ``ranks``; the job (``PrefetchJob``) or None when not started."""
    if node_agent is None or not namespace or not ranks or not enabled():
        return None

    def done(job: Any) -> None:
        summary = job.summary()
        fetched = {ns: r for ns, r in summary["results"].items() if "error" not in r}
        failed = {ns: r["error"] for ns, r in summary["results"].items() if "error" in r}
        events.emit("prefetch", generation=generation, phase="done", ok=job.ok, bytes=job.nbytes,
                    seconds=summary["seconds"], fetched=fetched)
        if failed:
            events.emit("warning", generation=generation,
                        what=f"prefetch from peers failed, the workers' load fetches for itself: {failed}")

    events.emit("prefetch", generation=generation, phase="started", namespace=namespace, ranks=list(ranks))
    return node_agent.prefetch(namespace, list(ranks), done)
