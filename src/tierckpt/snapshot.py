"""Taking a snapshot: one copy of a state dict's tensors into a shared-memory slot.

The slot is laid out as the rank's data file will be: for each tensor (a DTensor's local
shard, each local shard of a ShardedTensor) a ``torch.save``-compatible record whose raw
bytes the copy fills in place, so the commit later only links the slot into the step;
nothing is copied twice and nothing is pickled. The layout is cached while the state
dict's structure (keys, shapes, dtypes) stays the same. On CUDA the slot is registered as
pinned memory once and device-to-host copies run on a side stream;
``Snapshot.wait_copied()`` returns when they have landed.

An overlapped stage (``stage(..., copier=executor)``) lays out the slot, writes the record
headers and deep-copies the non-tensor values on the caller's thread, then returns with the
tensor data still being copied: on a background thread (CPU) or on the side stream (CUDA,
the caller's stream untouched until ``Snapshot.fence()`` makes it wait). With ``checksums``
the source bytes are hashed at the call and compared with the slot after the copy, so a
tensor changed before its copy landed is reported (``SnapshotChangedError``), naming the key.

Call order: ``Stager.stage(state_dict)`` (blocking part of a save) → ``Snapshot.wait_copied()``
→ the writer reads ``Snapshot.views`` / ``Snapshot.state_dict`` → ``Stager.release(snapshot)``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from tierckpt._torch_compat import flatten_state_dict, is_sharded_tensor, sharded_like
from tierckpt.errors import SnapshotChangedError, StorageError, TierckptError, UnsaveableObjectError
from tierckpt.layout import checksum
from tierckpt.record import ALIGN, TensorRecord, tensor_record
from tierckpt.staging import Slot

__all__ = ["Snapshot", "Stager", "resolve_stateful", "shard_key"]

_record = lru_cache(maxsize=8192)(tensor_record)


@dataclass
class Snapshot:
    """A state dict copied into ``slot``.

    state_dict  same structure as the original: plain tensors are views into the slot,
                DTensors stay as they were (planning reads only their metadata),
                ShardedTensors are rebuilt with the same global metadata around slot views
                of their local shards, other values are deep copies
    views       key → slot view holding that tensor's (local) data; the key is the flattened
                key, or ``shard_key(key, offsets)`` for each local shard of a ShardedTensor
                (and, in ``stage_items``, for every shard of a sharded tensor): ``key_of``
                finds it from a DCP item's index
    offsets     key → offset of that tensor's record in the slot
    """

    slot: Slot
    state_dict: dict[str, Any]
    views: dict[str, torch.Tensor]
    offsets: dict[str, int]
    records: dict[str, TensorRecord]
    nbytes: int
    _event: Any = field(default=None, repr=False)
    _copy: Future[None] | None = field(default=None, repr=False)  # CPU copy on a background thread
    _sums: dict[str, str] | None = field(default=None, repr=False)  # source checksums at the call
    step: int | None = None

    def key_of(self, index: MetadataIndex) -> str | None:
        """The key in ``views`` of the data DCP addresses as ``index``, or None when not staged."""
        if index.offset is not None:
            key = shard_key(index.fqn, index.offset)
            if key in self.views:
                return key
        return index.fqn if index.fqn in self.views else None

    def wait_copied(self) -> None:
        """Block until the data is in the slot; raise what the copy raised, or a changed source."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        if self._copy is not None:
            self._copy.result()
        if self._sums is not None:
            sums, self._sums = self._sums, None
            self._verify(sums)

    def _fill(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy the data on the CPU (caller's or copy thread), then check it in debug mode."""
        _copy_cpu(tensors, self.views)
        if self._sums is not None:
            sums, self._sums = self._sums, None
            self._verify(sums)

    def fence(self) -> None:
        """Order the caller after the copy: its CUDA stream waits on the copy, a CPU copy is waited for.

        Never raises: a failed copy is reported by ``wait_copied`` (the save's handle).
        """
        event = self._event
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        if self._copy is not None:
            self._copy.exception()

    def _verify(self, sums: dict[str, str]) -> None:
        buf = self.slot.buffer
        if buf is None:
            raise StorageError(f"the slot {self.slot.path} was unmapped during the copy", tier="memory",
                               path=str(self.slot.path), step=self.step)
        for key, expected in sums.items():
            start = self.offsets[key] + self.records[key].data_offset
            if checksum(buf[start : start + self.records[key].nbytes].numpy()) != expected:
                raise SnapshotChangedError(
                    f"overlapped save of step {self.step}: tensor {key!r} changed before its copy finished, so "
                    "the checkpoint would not hold its value at the save call; change tensors only after the "
                    "fence (ck.register_fence(optimizer) fences the optimizer's step; or handle.wait_staged(), ck.fence())",
                    key=key, step=self.step,
                )


class Pool(Protocol):
    """Where a Stager takes its slots: a ``SlotPool`` (shared memory) or ``fallback.HeapPool``."""

    def acquire(self, nbytes: int) -> Slot: ...

    def release(self, slot: Slot) -> None: ...


class Stager:
    """Copies state dicts into slots from ``pool``; caches the layout per structure."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self._layout_key: tuple[Any, ...] | None = None
        self._layout: tuple[dict[str, int], dict[str, TensorRecord], int] | None = None
        self._stream: Any = None
        self._pinned: dict[str, Slot] = {}  # slot name → the slot this stager registered with CUDA

    def stage(self, state_dict: dict[str, Any], *, copier: Executor | None = None, checksums: bool = False,
              step: int | None = None) -> Snapshot:
        """Copy a state dict's tensors (DTensors, ShardedTensors: their local shards); keep a shadow state dict.

        With ``copier`` the CPU data copy runs there and CUDA copies are not waited for:
        the caller must ``wait_copied()`` (or ``fence()``) before the tensors change.
        """
        tensors = _local_tensors(state_dict)
        snap = self._take(tensors, copier, _source_sums(tensors) if checksums else None, step)
        snap.state_dict = _rebuild(state_dict, "", snap.views)
        return snap

    def nbytes_of(self, state_dict: dict[str, Any]) -> int:
        """Bytes the slot of ``state_dict`` takes (layout only: no data is read)."""
        return self._plan(_local_tensors(state_dict))[2]

    def stage_items(self, items: Any, planner: Any) -> Snapshot:
        """Synchronous saves: copy the tensors of a DCP plan (as the planner resolves them)."""
        tensors: dict[str, torch.Tensor] = {}
        for item in items:
            if item.tensor_data is None:
                continue
            # a rank may hold several shards of one ShardedTensor: each has a key of its own
            key = shard_key(item.index.fqn, item.index.offset) if item.type == WriteItemType.SHARD else item.index.fqn
            if key not in tensors:
                tensors[key] = planner.resolve_data(item)
        return self._take(tensors)

    def _take(self, tensors: dict[str, torch.Tensor], copier: Executor | None = None,
              sums: dict[str, str] | None = None, step: int | None = None) -> Snapshot:
        offsets, records, total = self._plan(tensors)
        slot = self.pool.acquire(total)
        try:
            views = self._views(slot, tensors, offsets, records)
            snap = Snapshot(slot, {}, views, offsets, records, total, _sums=sums, step=step)
            if any(t.is_cuda for t in tensors.values()):
                self._copy_cuda(slot, tensors, views)
                snap._event = torch.cuda.Event()
                snap._event.record(self._stream)
            elif copier is not None:
                snap._copy = copier.submit(snap._fill, tensors)
            else:
                snap._fill(tensors)
        except BaseException:
            self.pool.release(slot)
            raise
        return snap

    def release(self, snapshot: Snapshot) -> None:
        self.pool.release(snapshot.slot)

    def _plan(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, int], dict[str, TensorRecord], int]:
        key = tuple((k, t.dtype, tuple(t.shape)) for k, t in tensors.items())
        if key != self._layout_key or self._layout is None:
            offsets, records, offset = {}, {}, 0
            for k, t in tensors.items():
                rec = _record(t.dtype, tuple(t.shape))
                offsets[k], records[k] = offset, rec
                offset = (offset + rec.length + ALIGN - 1) // ALIGN * ALIGN
            self._layout_key, self._layout = key, (offsets, records, offset)
        return self._layout

    def _views(self, slot: Slot, tensors: dict[str, torch.Tensor], offsets: dict[str, int],
               records: dict[str, TensorRecord]) -> dict[str, torch.Tensor]:
        """Write each record's header and trailer; return the slot views the data goes into."""
        buf = _buffer(slot)
        raw = buf.numpy()  # plain numpy stores: ~1 us a header where torch ops cost ~20
        views = {}
        for k, t in tensors.items():
            rec, off = records[k], offsets[k]
            raw[off : off + len(rec.prefix)] = _bytes_array(rec.prefix)
            start = off + rec.data_offset
            end = start + rec.nbytes
            views[k] = buf[start:end].view(t.dtype).view(t.shape) if rec.nbytes else torch.empty(t.shape, dtype=t.dtype)
            if rec.suffix:
                raw[end : end + len(rec.suffix)] = _bytes_array(rec.suffix)
        return views

    def _copy_cuda(self, slot: Slot, tensors: dict[str, torch.Tensor], views: dict[str, torch.Tensor]) -> None:
        """Queue device-to-host copies on the side stream, after the work queued so far."""
        self._pin(slot)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for k, t in tensors.items():
                if views[k].numel() == 0:
                    continue
                if t.is_cuda:
                    # the caching allocator must not hand this memory out before the copy read it
                    t.record_stream(self._stream)
                views[k].copy_(t.detach(), non_blocking=True)

    def _pin(self, slot: Slot) -> None:
        """Register the slot's mapping with CUDA once, so D2H copies land in it directly."""
        buf = _buffer(slot)
        ptr = buf.data_ptr()
        if slot.registered == ptr or buf.numel() == 0:
            return
        slot.unregister()  # an earlier mapping of this slot (Slot.unmap unregisters too)
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(ptr, buf.numel(), 0)
        if int(rc) == 0:
            slot.registered = ptr
            self._pinned[slot.path.name] = slot

    def close(self) -> None:
        for slot in self._pinned.values():
            slot.unregister()
        self._pinned.clear()


@lru_cache(maxsize=8192)
def _bytes_array(data: bytes) -> Any:
    """A read-only uint8 array over ``data`` (headers repeat from save to save)."""
    return np.frombuffer(data, dtype=np.uint8)


def _buffer(slot: Slot) -> torch.Tensor:
    if slot.buffer is None:
        raise StorageError(f"shared-memory slot {slot.path} is not mapped", tier="memory", path=str(slot.path))
    return slot.buffer


def shard_key(fqn: str, offsets: Sequence[int]) -> str:
    """The snapshot key of the shard of ``fqn`` at ``offsets`` (``"model.w@[4, 0]"``)."""
    return f"{fqn}@{[int(o) for o in offsets]}"


def _local_tensors(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Flattened key → the tensor to copy: a DTensor's local shard, each local shard of a ShardedTensor."""
    flat, _ = flatten_state_dict(state_dict)
    out: dict[str, torch.Tensor] = {}
    for k, v in flat.items():
        if is_sharded_tensor(v):  # before Tensor: a ShardedTensor is one, and refuses most ops
            for shard in v.local_shards():
                if is_sharded_tensor(shard.tensor):
                    raise UnsaveableObjectError(
                        f"state dict key {k!r} holds a ShardedTensor nested in a ShardedTensor (FSDP's 2-D "
                        "SHARDED_STATE_DICT), which tierckpt cannot stage; build FSDP with a device_mesh, "
                        "so that its state dict holds DTensors", key=k,
                    )
                out[shard_key(k, shard.metadata.shard_offsets)] = shard.tensor
        elif isinstance(v, DTensor):
            out[k] = v.to_local()
        elif isinstance(v, torch.Tensor):
            out[k] = v
    return out


def _copy_cpu(tensors: dict[str, torch.Tensor], views: dict[str, torch.Tensor]) -> None:
    """Copy every tensor into its slot view; one call into torch where it can (the GIL is
    released once for the whole copy, so a training thread in Python is not held up)."""
    pairs = [(views[k], t.detach()) for k, t in tensors.items() if views[k].numel()]
    if _FOREACH_COPY is not None and pairs:
        try:
            _FOREACH_COPY([d for d, _ in pairs], [x for _, x in pairs])
            return
        except RuntimeError:
            pass  # copy one by one below, to name the tensor that fails
    for k, t in tensors.items():
        if views[k].numel():
            try:
                views[k].copy_(t.detach())
            except RuntimeError as exc:  # torch cannot copy this tensor densely (sparse, meta, ...)
                raise TierckptError(f"tensor {k!r} cannot be copied into shared memory: {exc}; save a dense, "
                                    "materialized tensor (e.g. .to_dense())") from exc


# a private torch op: used when present, else the per-tensor loop (same result, more GIL hand-offs)
_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)


def _source_sums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Debug mode: each tensor's bytes hashed at the call (a device tensor is read back first)."""
    sums = {}
    for k, t in tensors.items():
        if t.numel() == 0:
            continue
        host = t.detach().cpu().contiguous()
        sums[k] = checksum(host.reshape(-1).view(torch.uint8).numpy())
    return sums


def resolve_stateful(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Top-level ``Stateful`` values replaced by their ``state_dict()``, as ``dcp.save`` does."""
    # tensors and containers first: the runtime Protocol check is slow (~15 us a value)
    return {k: (v.state_dict() if not isinstance(v, (torch.Tensor, dict, list)) and isinstance(v, Stateful) else v)
            for k, v in state_dict.items()}


def _rebuild(obj: Any, prefix: str, views: dict[str, torch.Tensor]) -> Any:
    """The shadow state dict: same nesting as DCP flattens it, tensors swapped for slot views."""
    if is_sharded_tensor(obj):
        return sharded_like(obj, [views[shard_key(prefix, s.metadata.shard_offsets)] for s in obj.local_shards()])
    if isinstance(obj, DTensor):
        return obj
    if isinstance(obj, torch.Tensor):
        return views[prefix]
    if isinstance(obj, dict):
        return {k: _rebuild(v, f"{prefix}.{k}" if prefix else str(k), views) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, f"{prefix}.{i}" if prefix else str(i), views) for i, v in enumerate(obj)]
    return copy.deepcopy(obj)
