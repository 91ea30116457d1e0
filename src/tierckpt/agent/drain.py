"""Drains owned by the agent: copy a namespace's newest memory step to the durable tier.

``flush`` (the launcher calls it on exit: "persist what memory holds, then stop") copies, for
each namespace on this node, the newest committed memory step that has no durable copy: this
node's data files first, then, once every file the manifest lists is in the durable staging
area, the small files and the marker, last (``tiers/copy.py``). With several nodes
each agent copies its own files; whichever finds the set complete commits (one claim file
decides on a filesystem tier). A trainer killed mid-drain loses nothing: the agent's copy
does not depend on it.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from tierckpt.config import CheckpointConfig
from tierckpt.errors import ConfigError, TierckptError
from tierckpt.observability import get_logger, throughput
from tierckpt.tiers import LocalTier, open_durable
from tierckpt.tiers.copy import commit_step, pin_files, put_files, sealed_step

if TYPE_CHECKING:
    from tierckpt.agent.state import NodeState

__all__ = ["drain_lag", "flush", "refresh_drain_lag"]

_log = get_logger("agent")


def flush(state: NodeState, namespace: str | None) -> dict[str, Any]:
    url = state.config.durable_url
    if url is None:
        return {"ok": True, "drained": {}, "note": "no durable_url: nothing to flush"}
    out: dict[str, Any] = {}
    errors: list[str] = []
    for ns in [namespace] if namespace else state.store.namespaces():
        try:
            out[ns] = drain_newest(state, ns, url)
        except (TierckptError, OSError) as exc:
            errors.append(f"{ns}: {exc}")
    state.drain_state = {"last_flush": time.time(), "drained": out, "errors": errors}
    try:
        refresh_drain_lag(state)
    except (TierckptError, OSError) as exc:
        errors.append(f"drain lag: {exc}")
    return {"ok": not errors, "drained": out, "error": "; ".join(errors) or None}


def refresh_drain_lag(state: NodeState, *, list_durable: bool = True) -> dict[str, dict[str, Any]]:
    """Per namespace: the newest memory and durable steps and the lag between them.

    ``list_durable`` False reuses the newest durable step found last time (listing an S3
    tier is a request; memory is read every time).
    """
    known = {ns: v["newest_durable"] for ns, v in state.drain_lag.items() if "newest_durable" in v}
    if list_durable:
        state.drain_listed()
        known = {}
    state.drain_lag = {ns: drain_lag(state, ns, known) for ns in state.store.namespaces()}
    state.metrics.drain_lag.set(sum(int(v.get("lag_steps", 0)) for v in state.drain_lag.values()))
    return state.drain_lag


def drain_lag(state: NodeState, ns: str, known: dict[str, int | None]) -> dict[str, Any]:
    """{newest_memory, newest_durable, lag_steps}: this node's committed memory steps of ``ns``
    newer than the newest durable step (0 when the newest is durable, or nothing is held).
    The durable tier is listed unless ``known`` has its newest step already."""
    url = state.config.durable_url
    memory = [s.step for s in state.store.own(ns).list_steps()]
    if url is None:
        return {"newest_memory": memory[-1] if memory else None}
    if ns in known:
        newest = known[ns]
        return {"newest_memory": memory[-1] if memory else None, "newest_durable": newest,
                "lag_steps": sum(1 for s in memory if newest is None or s > newest)}
    durable = open_durable(CheckpointConfig(namespace=ns, memory_dir=state.config.memory_dir, durable_url=url))
    try:
        steps = [s.step for s in durable.list_steps()] if durable is not None else []
    except (TierckptError, OSError) as exc:
        return {"newest_memory": memory[-1] if memory else None, "error": str(exc)[:200]}
    finally:
        closer = getattr(durable, "close", None)
        if closer is not None:
            closer()
    newest = steps[-1] if steps else None
    lag = sum(1 for s in memory if newest is None or s > newest)
    return {"newest_memory": memory[-1] if memory else None, "newest_durable": newest, "lag_steps": lag}


def drain_newest(state: NodeState, ns: str, url: str) -> dict[str, Any]:
    memory = state.store.own(ns)
    steps = memory.list_steps()
    if not steps:
        return {"state": "empty"}
    newest = steps[-1]
    durable = open_durable(CheckpointConfig(namespace=ns, memory_dir=state.config.memory_dir, durable_url=url))
    if durable is None:
        raise ConfigError(f"durable_url {url!r} names no durable tier; pass file:///path or s3://bucket/prefix")
    try:
        if any(s.step == newest.step for s in durable.list_steps()):
            return {"step": newest.step, "state": "durable"}
        sealed = sealed_step(memory, newest.step, ns)
        save_id = sealed.manifest.save_id
        t0 = time.perf_counter()
        mine = sorted(n for n in newest.files if n in sealed.manifest.files)
        nbytes = put_files(durable, newest.step, save_id, pin_files(memory, newest.step, mine))
        if not _complete_and_claimed(durable, newest.step, save_id, set(sealed.manifest.files), set(mine)):
            return {"step": newest.step, "state": "partial", "files": mine}
        commit_step(durable, newest.step, save_id, sealed.metadata, sealed.manifest_raw)
        _log.info("[Agent %s] Step %d: drained %s to %s in %s", state.node_id, newest.step, ns,
                  durable.location(newest.step), throughput(nbytes, time.perf_counter() - t0))
        return {"step": newest.step, "state": "durable", "files": mine}
    finally:
        closer = getattr(durable, "close", None)
        if closer is not None:
            closer()


def _complete_and_claimed(durable: Any, step: int, save_id: str, wanted: set[str], mine: set[str]) -> bool:
    """True when every data file is staged and this agent won the right to commit."""
    if wanted <= mine:
        return True
    if not isinstance(durable, LocalTier):
        return False  # another node's agent commits once it holds the rest (S3: one node's files only)
    staging = durable.staging_dir(step, save_id)
    if not all((staging / n).exists() for n in wanted):
        return False
    try:
        fd = os.open(staging / ".commit-claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError:  # claimed by another agent, or committed already (staging renamed)
        return False
    os.close(fd)
    (staging / ".commit-claim").unlink(missing_ok=True)  # the marker must be the only extra file
    return True
