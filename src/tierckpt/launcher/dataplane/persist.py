"""Persist on the way out: the newest committed memory step without a durable copy becomes durable.

Called by every agent when the job is preempted (SIGTERM) or fails for good. Each node copies
the data files its memory tier holds (verified first: a copy that fails its checksums is not
sent); ``barrier()`` waits for the other nodes; then the leader (group rank 0) commits the
step, marker last, if every file the manifest lists was copied. With one node the leader holds
every file and needs no barrier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from tierckpt import layout
from tierckpt.config import CheckpointConfig
from tierckpt.integrity import sealed_manifest, verified_metadata, verify_copy
from tierckpt.tiers import open_durable, open_memory

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
    manifest = sealed_manifest(memory, newest, config.namespace)
    report = verify_copy(memory, newest, config.namespace, require_all_files=False)
    if not report.ok:
        log.warning("persist: step %s in memory fails verification (%s); not copied", newest, report.problems)
        return None
    held = set(mem[-1].files)
    for name in sorted(manifest.files):
        if name in held and name.endswith(".distcp"):
            durable.put_file(newest, manifest.save_id, name, memory.step_dir(newest) / name)
    holds_all = all(n in held for n in manifest.files)
    all_there = holds_all or (barrier() if barrier is not None else False)
    if not leader and not holds_all:
        return newest
    if not all_there:
        log.warning("persist: not every node copied its files of step %s; not committed", newest)
        return None
    durable.commit(newest, manifest.save_id, {
        layout.METADATA: verified_metadata(memory, manifest),
        layout.MANIFEST: memory.read_file(newest, layout.MANIFEST),
    })
    log.info("persist: step %s is durable at %s", newest, durable.location(newest))
    return newest
