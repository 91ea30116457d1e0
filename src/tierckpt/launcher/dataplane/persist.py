"""Persist on the way out: the newest committed memory step without a durable copy becomes durable.

Called by every agent when the job is preempted (SIGTERM) or fails for good. Each node copies
the data files its memory tier holds (``tiers/copy.py``; pinned and verified first: a copy that
fails its checksums is not sent); ``barrier()`` waits for the other nodes; then the leader (group rank 0) commits the
step, marker last, if every file the manifest lists was copied. With one node the leader holds
every file and needs no barrier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from tierckpt.config import CheckpointConfig
from tierckpt.errors import IntegrityError
from tierckpt.tiers import open_durable, open_memory
from tierckpt.tiers.copy import check_files, commit_step, pin_files, put_files, sealed_step

__all__ = ["persist_all", "persist_newest"]

log = logging.getLogger("tierckpt.run")


def persist_all(config: CheckpointConfig, *, leader: bool,
                barrier: Callable[[], bool] | None = None) -> dict[str, int | None]:
    """``persist_newest`` for the namespace and for each of its local-mode namespaces on this node."""
    root = Path(config.memory_dir)
    names = [config.namespace] + sorted(p.name for p in root.glob(f"{config.namespace}--rank*") if p.is_dir())
    return {ns: persist_newest(config.replace(namespace=ns), leader=leader,
                               barrier=barrier if ns == config.namespace else None) for ns in names}


def persist_newest(config: CheckpointConfig, *, leader: bool,
                   barrier: Callable[[], bool] | None = None) -> int | None:
    """Make the newest committed memory step durable; return its step, or None when nothing to do."""
    durable = open_durable(config)
    if durable is None:
        return None
    memory = open_memory(config)
    mem = memory.list_steps()
    if not mem:
        return None
    newest = mem[-1].step
    if any(s.step == newest for s in durable.list_steps()):
        return None
    held = set(mem[-1].files)
    try:
        sealed = sealed_step(memory, newest, config.namespace)
        manifest = sealed.manifest
        pins = pin_files(memory, newest, [n for n in sorted(manifest.files) if n in held and n.endswith(".distcp")])
        check_files(pins, manifest, memory.location(newest))
    except IntegrityError as exc:
        log.warning("persist: step %s in memory fails verification (%s); not copied", newest, exc)
        return None
    put_files(durable, newest, manifest.save_id, pins)
    holds_all = all(n in held for n in manifest.files)
    all_there = holds_all or (barrier() if barrier is not None else False)
    if not leader and not holds_all:
        return newest
    if not all_there:
        log.warning("persist: not every node copied its files of step %s; not committed", newest)
        return None
    commit_step(durable, newest, manifest.save_id, sealed.metadata, sealed.manifest_raw)
    log.info("persist: step %s is durable at %s", newest, durable.location(newest))
    return newest
