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
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from tierckpt import guard, layout, metrics
from tierckpt._torch_compat import StorageInfo
from tierckpt.config import CheckpointConfig
from tierckpt.dcp.plan import ItemInfo, PlanData, checksums_of, durable_tier, spans_of
from tierckpt.errors import DurableWriteError, MemoryBudgetError, StorageError, TierckptError
from tierckpt.observability import StepLogger
from tierckpt.runtime import RankRuntime
from tierckpt.snapshot import Snapshot, Stager
from tierckpt.staging import Slot

__all__ = ["HeapPool", "agree", "memory_failure", "release"]

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
            if seen.tier not in (None, "memory"):  # another tier's failure (the durable one's, say)
                return None
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


class WriterState(Protocol):
    """What the plug-ins below read and set on the ``TieredStorageWriter`` that calls them.

    Named here rather than imported, so that ``writer.py`` imports this module one way.
    """

    config: CheckpointConfig
    rank: int
    committed: tuple[bytes, bytes] | None
    files_written: list[str]
    _step: int | None
    _snapshot: Snapshot | None
    _memory_failure: BaseException | None

    @property
    def step(self) -> int: ...

    @property
    def durable(self) -> bool: ...

    @property
    def runtime(self) -> RankRuntime: ...


# -- the DCP plug-ins (TieredStorageWriter calls these three where the memory tier fails) --------
def stage_instead(writer: WriterState, err: BaseException, state_dict: dict[str, Any]) -> Snapshot:
    """``stage`` could not copy into shared memory: copy into process memory when the save goes durable."""
    cause = memory_failure(err)
    if cause is None or not _goes_durable(writer):
        raise err from err.__cause__
    _warn(writer, cause, err)
    writer._memory_failure = err
    return heap_stager().stage(guard.saveable(state_dict, writer.step))


def write_instead(writer: WriterState, exc: BaseException, plan: SavePlan, planner: SavePlanner,
                  pd: PlanData, log: StepLogger) -> list[WriteResult]:
    """``write_data`` failed: when the memory tier is why and the save goes durable, write only there."""
    err = guard.typed(exc, step=writer._step)
    cause = memory_failure(err)
    if cause is None or not _goes_durable(writer):
        raise exc
    if writer._memory_failure is None:
        _warn(writer, cause, err)
    writer.runtime.memory.abort(writer.step, pd.save_id)  # this rank's staged memory files, if any
    snap, writer._snapshot = writer._snapshot, None
    if snap is None or snap.slot.path != HEAP:  # the slot was handed back: copy what DCP resolves
        if snap is not None:
            release(writer.runtime, snap)
        snap = heap_stager().stage_items(plan.items, planner)
    return write_durable(writer, snap, plan, planner, pd, log, f"rank {writer.rank}: {cause}: {err}")


def commit_instead(writer: WriterState, infos: Iterable[ItemInfo], save_id: str,
                   small: dict[str, bytes]) -> bool:
    """Commit the memory tier (False), or, where it failed on some rank, the durable tier alone (True)."""
    rt, step = writer.runtime, writer.step
    infos = list(infos)
    failed = sorted({i.memory_error for i in infos if i.memory_error})
    if not failed:
        try:
            rt.memory.commit(step, save_id, small)
            return False
        except StorageError as exc:
            cause = memory_failure(exc)
            if cause is None or not _goes_durable(writer):
                raise
            _warn(writer, cause, exc)
            failed = [f"rank {writer.rank}: {cause}: {exc}"]
    rt.memory.abort(step, save_id)
    broken = sorted({i.durable_error for i in infos if i.durable_error})
    if broken:
        raise DurableWriteError(f"step {step} was not saved: the memory tier failed ({'; '.join(failed)}) and "
                                f"so did the durable copy: {'; '.join(broken)}", tier="durable", step=step)
    durable = durable_tier(rt, step)
    try:
        durable.commit(step, save_id, small)
    except StorageError as exc:
        raise DurableWriteError(f"step {step} was not saved: the memory tier failed ({'; '.join(failed)}) and so "
                                f"did the durable commit: {exc}", tier="durable", step=step) from exc
    writer.committed = (small[layout.METADATA], small[layout.MANIFEST])
    StepLogger("writer", writer.rank, writer.config.logger).info(
        step, "Committed to the durable tier only (%s): %s", durable.location(step), "; ".join(failed))
    rt.apply_retention(durable, rt.durable_retention)
    return True


def write_durable(writer: WriterState, snap: Snapshot, plan: SavePlan, planner: SavePlanner,
                  pd: PlanData, log: StepLogger, memory_error: str) -> list[WriteResult]:
    """This rank's files of the step from ``snap`` to the durable tier; ``snap`` is released."""
    rt, step = writer.runtime, writer.step
    durable = durable_tier(rt, step)
    extra_name = pd.file_name.replace("_0.distcp", "_1.distcp")
    view = memoryview(snap.slot._mm) if snap.slot._mm is not None else memoryview(b"")
    files: dict[str, memoryview | bytes] = {}
    try:
        snap.wait_copied()
        spans, extras = spans_of(plan.items, planner, snap, pd.file_name, extra_name)
        digests = checksums_of(rt, spans, {pd.file_name: snap.slot, extra_name: extras})
        sizes = {pd.file_name: snap.nbytes, extra_name: len(extras)}
        files[pd.file_name] = view[: snap.nbytes]
        if extras:
            files[extra_name] = bytes(extras)
        with log.timed(step, f"Durable write, memory tier bypassed ({durable.location(step)})",
                       snap.nbytes + len(extras)):
            for name, source in files.items():
                durable.put_file(step, pd.save_id, name, source)
    finally:
        for source in files.values():
            if isinstance(source, memoryview):
                source.release()
        view.release()
        release(rt, snap)
    writer.files_written = sorted(files)
    return [
        WriteResult(index=item.index, size_in_bytes=length,
                    storage_data=ItemInfo(StorageInfo(name, offset, length), data_offset, digest, sizes[name],
                                           memory_error=memory_error))
        for (item, name, offset, length, data_offset), digest in zip(spans, digests, strict=True)
    ]


def _goes_durable(writer: WriterState) -> bool:
    return writer.config.durable_url is not None and writer.durable


def _warn(writer: WriterState, cause: str, err: BaseException) -> None:
    """Warn at a runtime's first fallback (later ones log at info); count each."""
    rt = writer.runtime
    metrics.memory_fallback(rt, cause)
    log = StepLogger("writer", writer.rank, writer.config.logger)
    say = log.info if rt.fallbacks else log.warning
    rt.fallbacks += 1
    say(writer.step, "the memory tier failed (%s: %s); this save goes straight to the durable tier (%s)",
        cause, err, writer.config.durable_url)
