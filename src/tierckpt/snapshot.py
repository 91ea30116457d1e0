"""Taking a snapshot: one copy of a state dict's tensors into a shared-memory slot.

The slot is laid out as the rank's data file will be: for each tensor (or DTensor local
shard) a ``torch.save``-compatible record whose raw bytes the copy fills in place, so the
commit later only links the slot into the step; nothing is copied twice and nothing is
pickled. The layout is cached while the state dict's structure (keys, shapes, dtypes)
stays the same. On CUDA the slot is registered as pinned memory once and device-to-host
copies run on a side stream; ``Snapshot.wait_copied()`` returns when they have landed.

Call order: ``Stager.stage(state_dict)`` (blocking part of a save) → the writer reads
``Snapshot.views`` / ``Snapshot.state_dict`` → ``Stager.release(snapshot)``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from tierckpt._torch_compat import flatten_state_dict
from tierckpt.record import ALIGN, TensorRecord, tensor_record
from tierckpt.staging import Slot, SlotPool

__all__ = ["Snapshot", "Stager", "resolve_stateful"]

_record = lru_cache(maxsize=8192)(tensor_record)


@dataclass
class Snapshot:
    """A state dict copied into ``slot``.

    state_dict  same structure as the original: plain tensors are views into the slot,
                DTensors stay as they were (planning reads only their metadata), other
                values are deep copies
    views       flattened key → slot view holding that tensor's (local) data
    offsets     flattened key → offset of that tensor's record in the slot
    """

    slot: Slot
    state_dict: dict[str, Any]
    views: dict[str, torch.Tensor]
    offsets: dict[str, int]
    records: dict[str, TensorRecord]
    nbytes: int
    _event: Any = field(default=None, repr=False)

    def wait_copied(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None


class Stager:
    """Copies state dicts into slots from ``pool``; caches the layout per structure."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self._layout_key: tuple[Any, ...] | None = None
        self._layout: tuple[dict[str, int], dict[str, TensorRecord], int] | None = None
        self._stream: Any = None
        self._pinned: dict[str, int] = {}  # slot name → registered pointer

    def stage(self, state_dict: dict[str, Any]) -> Snapshot:
        """Copy a state dict's tensors (DTensors: their local shards); keep a shadow state dict."""
        flat, _ = flatten_state_dict(state_dict)
        tensors = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in flat.items() if isinstance(v, torch.Tensor)}
        snap = self._take(tensors)
        snap.state_dict = _rebuild(state_dict, "", snap.views)
        return snap

    def stage_items(self, items: Any, planner: Any) -> Snapshot:
        """Synchronous saves: copy the tensors of a DCP plan (as the planner resolves them)."""
        tensors: dict[str, torch.Tensor] = {}
        for item in items:
            if item.tensor_data is not None and item.index.fqn not in tensors:
                tensors[item.index.fqn] = planner.resolve_data(item)
        return self._take(tensors)

    def _take(self, tensors: dict[str, torch.Tensor]) -> Snapshot:
        offsets, records, total = self._plan(tensors)
        slot = self.pool.acquire(total)
        try:
            views = self._copy(slot, tensors, offsets, records)
        except BaseException:
            self.pool.release(slot)
            raise
        event = None
        if self._stream is not None and any(t.is_cuda for t in tensors.values()):
            event = torch.cuda.Event()
            event.record(self._stream)
        return Snapshot(slot, {}, views, offsets, records, total, event)

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

    def _copy(self, slot: Slot, tensors: dict[str, torch.Tensor], offsets: dict[str, int],
              records: dict[str, TensorRecord]) -> dict[str, torch.Tensor]:
        buf = slot.buffer
        assert buf is not None
        on_cuda = any(t.is_cuda for t in tensors.values())
        if on_cuda:
            self._pin(slot)
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
        views = {}
        for k, t in tensors.items():
            rec, off = records[k], offsets[k]
            buf[off : off + len(rec.prefix)].copy_(torch.frombuffer(bytearray(rec.prefix), dtype=torch.uint8))
            start = off + rec.data_offset
            dst = buf[start : start + rec.nbytes].view(t.dtype).view(t.shape) if rec.nbytes else torch.empty(t.shape, dtype=t.dtype)
            if rec.nbytes:
                if t.is_cuda:
                    with torch.cuda.stream(self._stream):
                        dst.copy_(t.detach(), non_blocking=True)
                else:
                    dst.copy_(t.detach())
            end = start + rec.nbytes
            if rec.suffix:
                buf[end : end + len(rec.suffix)].copy_(torch.frombuffer(bytearray(rec.suffix), dtype=torch.uint8))
            views[k] = dst
        return views

    def _pin(self, slot: Slot) -> None:
        """Register the slot's mapping with CUDA once, so D2H copies land in it directly."""
        buf = slot.buffer
        assert buf is not None
        ptr = buf.data_ptr()
        if self._pinned.get(slot.path.name) == ptr or buf.numel() == 0:
            return
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(ptr, buf.numel(), 0)
        if int(rc) == 0:
            self._pinned[slot.path.name] = ptr

    def close(self) -> None:
        if self._pinned and torch.cuda.is_available():
            for ptr in self._pinned.values():
                torch.cuda.cudart().cudaHostUnregister(ptr)
        self._pinned.clear()


def resolve_stateful(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Top-level ``Stateful`` values replaced by their ``state_dict()``, as ``dcp.save`` does."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state_dict.items()}


def _rebuild(obj: Any, prefix: str, views: dict[str, torch.Tensor]) -> Any:
    """The shadow state dict: same nesting as DCP flattens it, tensors swapped for slot views."""
    if isinstance(obj, DTensor):
        return obj
    if isinstance(obj, torch.Tensor):
        return views[prefix]
    if isinstance(obj, dict):
        return {k: _rebuild(v, f"{prefix}.{k}" if prefix else str(k), views) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, f"{prefix}.{i}" if prefix else str(i), views) for i, v in enumerate(obj)]
    return copy.deepcopy(obj)
