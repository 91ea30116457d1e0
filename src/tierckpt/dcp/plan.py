"""What a DCP write plan holds, shared by the writer and its durable fallback (``fallback.py``).

``PlanData`` rides on each rank's ``SavePlan`` (the coordinator's choice of file and save id);
``ItemInfo`` on each ``WriteResult`` (what the manifest needs). ``spans_of`` places each item's
record in the staged slot or in an extras file, ``checksums_of`` hashes them, ``durable_tier``
is the rank's durable tier or a ``ConfigError``.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from tierckpt import layout
from tierckpt._torch_compat import StorageInfo
from tierckpt.errors import ConfigError, ProtocolError, TierckptError
from tierckpt.record import ALIGN, tensor_record
from tierckpt.runtime import RankRuntime
from tierckpt.snapshot import Snapshot
from tierckpt.staging import Slot
from tierckpt.tiers import Tier

__all__ = ["ItemInfo", "PlanData", "checksums_of", "durable_tier", "spans_of"]

_tensor_record = lru_cache(maxsize=8192)(tensor_record)


@dataclass(frozen=True)
class PlanData:
    """Set on each rank's SavePlan by the coordinator.

    ``commit_node``: this rank commits its node's memory tier once the coordinator has
    published the step (the coordinator commits its own node in ``finish``).
    ``remote_nodes``: how many other nodes wait for that publication.
    """

    file_name: str
    save_id: str
    world_size: int
    commit_node: bool = False
    remote_nodes: int = 0


@dataclass(frozen=True)
class ItemInfo:
    """WriteResult.storage_data: DCP's storage info plus what the manifest needs."""

    storage: StorageInfo
    data_offset: int
    xxh3: str
    file_size: int
    durable_error: str | None = None
    memory_error: str | None = None  # this rank's memory tier failed: the step goes to the durable tier only


def spans_of(
    items: Sequence[WriteItem], planner: SavePlanner, snap: Snapshot, slot_name: str, extra_name: str
) -> tuple[list[tuple[WriteItem, str, int, int, int]], bytearray]:
    """Where each item's record lives: in the slot when the snapshot holds it, else in extras.

    Returns (item, file, offset, length, data_offset) per item and the extras file's bytes
    (byte items, and tensors the snapshot does not hold in the planned shape).
    """
    spans = []
    extras = bytearray()
    for item in items:
        if item.type != WriteItemType.BYTE_IO:
            td = item.tensor_data
            if td is None:
                raise ProtocolError(f"tensor item {item.index.fqn} has no tensor_data in the save plan")
            key = snap.key_of(item.index)
            if key is not None and _holds(snap.views[key], td.chunk.sizes, td.properties.dtype):
                rec = snap.records[key]
                spans.append((item, slot_name, snap.offsets[key], rec.length, rec.data_offset))
                continue
            src = cast(torch.Tensor, planner.resolve_data(item)).detach().contiguous().cpu()
            rec = _tensor_record(src.dtype, tuple(src.shape))
            offset = _align(len(extras))
            extras.extend(b"\0" * (offset - len(extras)))
            extras.extend(rec.prefix)
            extras.extend(src.reshape(-1).view(torch.uint8).numpy().tobytes() if rec.nbytes else b"")
            extras.extend(rec.suffix)
            spans.append((item, extra_name, offset, rec.length, rec.data_offset))
            continue
        data = planner.resolve_data(item)
        if not isinstance(data, io.BytesIO):
            raise TierckptError(f"byte item {item.index.fqn} resolved to {type(data).__name__}")
        offset = _align(len(extras))
        extras.extend(b"\0" * (offset - len(extras)))
        extras.extend(data.getbuffer())
        spans.append((item, extra_name, offset, len(extras) - offset, -1))
    return spans, extras


def checksums_of(rt: RankRuntime, spans: list[tuple[WriteItem, str, int, int, int]], sources: dict[str, Any]) -> list[str]:
    """xxh3 of every record, in parallel (xxhash releases the GIL)."""
    views = {
        name: (memoryview(src._mm) if src._mm is not None else memoryview(b"")) if isinstance(src, Slot) else memoryview(src)
        for name, src in sources.items()
    }
    try:
        return list(rt.executor.map(lambda sp: layout.checksum(views[sp[1]][sp[2] : sp[2] + sp[3]]), spans))
    finally:
        for v in views.values():  # let the slot's mapping be closed or resized later
            v.release()


def durable_tier(rt: RankRuntime, step: int) -> Tier:
    durable = rt.durable
    if durable is None:
        raise ConfigError("a durable copy was asked for but the config has no durable_url", step=step)
    return durable


def _holds(view: torch.Tensor, sizes: Sequence[int], dtype: torch.dtype) -> bool:
    """Whether a staged view holds a planned chunk as it is (else the planner's tensor goes to extras)."""
    return tuple(view.shape) == tuple(sizes) and view.dtype == dtype


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
