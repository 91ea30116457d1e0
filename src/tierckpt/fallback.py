"""The durable fallback: a save whose memory tier fails goes straight to the durable tier.

A full or unwritable memory file system, or a slot that cannot be sized, would otherwise fail
the save although a durable tier is configured (the reference library falls back to S3 then).

Call order (``SavePath``, one save):
  training thread  ``Stager.stage`` into shared memory fails: ``memory_failure(exc)`` names
                   the cause ('no_space', 'unwritable', 'error') or None (not the memory
                   tier's fault: the error stands) → ``heap_stager().stage`` copies the state
                   into this process's own memory (``HeapPool``) instead
  committer thread ``agree(failed, group)``: one all_reduce on the commit group (none in local
                   mode, where every rank saves alone); when any rank's memory tier failed,
                   every rank writes the step with ``DurableWriter`` in one ``dcp.save`` (its
                   data from its slot or heap copy, checksummed, the marker last). A memory
                   commit that fails inside DCP's save (every rank sees that failure) falls
                   back the same way, from the same copy.
The step then exists in the durable tier only and loads from there, verified.
"""

from __future__ import annotations

import errno
import mmap
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from tierckpt import layout
from tierckpt._torch_compat import StorageInfo
from tierckpt.dcp.writer import TieredStorageWriter, _checksums, _durable_tier, _ItemInfo, _PlanData, _spans
from tierckpt.errors import MemoryBudgetError, ProtocolError, StorageError, TierckptError
from tierckpt.observability import StepLogger
from tierckpt.record import dumps_metadata
from tierckpt.runtime import RankRuntime
from tierckpt.snapshot import Snapshot, Stager
from tierckpt.staging import Slot

__all__ = ["DurableWriter", "HeapPool", "agree", "memory_failure", "release"]

HEAP = Path("<process memory>")  # the path of every HeapPool slot: nothing on any file system


class HeapPool:
    """Slots in this process's anonymous memory: where a save stages when shared memory fails."""

    def acquire(self, nbytes: int) -> Slot:
        slot = Slot(HEAP, nbytes)
        if nbytes == 0:
            slot.buffer = torch.empty(0, dtype=torch.uint8)
        else:
            slot._mm = mmap.mmap(-1, nbytes)
            slot.buffer = torch.frombuffer(slot._mm, dtype=torch.uint8)
        return slot

    def release(self, slot: Slot) -> None:
        slot.unmap()


def heap_stager() -> Stager:
    return Stager(HeapPool())


def release(runtime: RankRuntime, snap: Snapshot) -> None:
    """Hand a snapshot's slot back to where it came from (shared memory or the heap)."""
    if snap.slot.path == HEAP:
        snap.slot.unmap()
    else:
        runtime.stager.release(snap)


def memory_failure(exc: BaseException) -> str | None:
    """The cause when ``exc`` is the memory tier failing ('no_space', 'unwritable', 'error'), else None.

    A ``MemoryBudgetError`` is not one: the budget is a cap the user set, and a save over it
    fails as the budget says.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, MemoryBudgetError):
            return None
        if isinstance(seen, TierckptError):
            if isinstance(seen, StorageError) and seen.tier == "memory":
                return _cause(seen)
        elif isinstance(seen, OSError):
            return _cause(seen)
        seen = seen.__cause__
    return None


def _cause(exc: OSError) -> str:
    codes = {exc.errno} | ({exc.__cause__.errno} if isinstance(exc.__cause__, OSError) else set())
    if errno.ENOSPC in codes or "full" in str(exc):
        return "no_space"
    if codes & {errno.EACCES, errno.EPERM, errno.EROFS}:
        return "unwritable"
    return "error"


def agree(failed: bool, group: Any) -> bool:
    """True on every rank when the memory tier failed on any rank of ``group`` (None: this rank alone)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return failed
    flag = torch.tensor([int(failed)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


class DurableWriter(TieredStorageWriter):
    """Writes one step to the durable tier only: the same files, checksums and manifest, marker last.

    The caller sets ``_snapshot`` (a slot or heap copy) and ``_release``; DCP then drives it as
    any writer (``write_data`` on every rank, ``finish`` on the coordinator).
    """

    def _write_locked(self, plan: SavePlan, planner: SavePlanner, pd: _PlanData, rt: RankRuntime,
                      step: int, log: StepLogger) -> list[WriteResult]:
        snap, self._snapshot = self._snapshot, None
        if snap is None:
            raise ProtocolError("the durable fallback needs the step's copy (DurableWriter._snapshot)")
        durable = _durable_tier(rt, step)
        extra_name = pd.file_name.replace("_0.distcp", "_1.distcp")
        view = memoryview(snap.slot._mm) if snap.slot._mm is not None else memoryview(b"")
        try:
            snap.wait_copied()
            spans, extras = _spans(plan.items, planner, snap, pd.file_name, extra_name)
            digests = _checksums(rt, spans, {pd.file_name: snap.slot, extra_name: extras})
            sizes = {pd.file_name: snap.nbytes, extra_name: len(extras)}
            files: dict[str, memoryview | bytes] = {pd.file_name: view[: snap.nbytes]}
            if extras:
                files[extra_name] = bytes(extras)
            with log.timed(step, f"Durable write, memory tier bypassed ({durable.location(step)})",
                           snap.nbytes + len(extras)):
                for name, source in files.items():
                    durable.put_file(step, pd.save_id, name, source)
        finally:
            view.release()
            release(rt, snap)
        self.files_written = sorted(files)
        return [
            WriteResult(index=item.index, size_in_bytes=length,
                        storage_data=_ItemInfo(StorageInfo(name, offset, length), data_offset, digest, sizes[name]))
            for (item, name, offset, length, data_offset), digest in zip(spans, digests, strict=True)
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        rt, step = self.runtime, self.step
        infos: dict[MetadataIndex, _ItemInfo] = {wr.index: wr.storage_data for rr in results for wr in rr}
        save_id = self.save_id
        if save_id is None:
            raise ProtocolError("finish called before write_data")
        metadata.storage_data = {idx: info.storage for idx, info in infos.items()}
        md_raw = dumps_metadata(metadata)
        manifest = layout.Manifest(
            namespace=self.config.namespace, step=step, save_id=save_id, world_size=len(results),
            metadata_xxh3=layout.checksum(md_raw),
            files={i.storage.relative_path: i.file_size for i in infos.values()},
            items=tuple(
                layout.ItemRecord(i.storage.relative_path, i.storage.offset, i.storage.length, i.data_offset, i.xxh3)
                for i in sorted(infos.values(), key=lambda i: (i.storage.relative_path, i.storage.offset))
            ),
        )
        mf_raw = manifest.to_bytes()
        self._check_gate()
        durable = _durable_tier(rt, step)
        durable.commit(step, save_id, {layout.METADATA: md_raw, layout.MANIFEST: mf_raw})
        self.committed = (md_raw, mf_raw)
        StepLogger("writer", self.rank, self.config.logger).info(
            step, "Committed to durable only (%s): the memory tier failed", durable.location(step))
        rt.apply_retention(durable, rt.durable_retention)
