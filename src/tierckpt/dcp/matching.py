"""Does the state dict match the checkpoint? Checked before any byte is read.

Call order (every rank, inside ``TieredStorageReader``): ``read_metadata`` → with an expected state
dict (``Checkpointer.load``), ``check_expected`` (keys the checkpoint lacks, shapes, tensor vs
object: always errors) → ``read_data`` → ``check_plan`` (dtype casts, and checkpoint keys the
state dict does not load). DCP allows both of the latter, and so does tierckpt, but not silently:
each is a ``LoadMismatchWarning`` naming the keys; with ``strict=True`` a StateDictMismatchError.
Per-rank items (``layout.is_rank_item``) are neither: other ranks' items are not this rank's to
load, and this rank's may be absent (a world larger than the one that saved; its owner decides).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.tensor import DTensor

from tierckpt import layout
from tierckpt._torch_compat import flatten_state_dict, is_sharded_tensor
from tierckpt.errors import LoadMismatchWarning, StateDictMismatchError
from tierckpt.observability import StepLogger
from tierckpt.snapshot import resolve_stateful

__all__ = ["LoadMismatchWarning", "check_expected", "check_plan"]


def _some(keys: list[str], limit: int = 8) -> str:
    return ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def check_plan(plan: LoadPlan, planner: LoadPlanner, metadata: Metadata, step: int, *, strict: bool, log: StepLogger, partial: bool = False) -> None:
    """Warn (or with ``strict`` raise) about dtype casts and checkpoint keys left unloaded."""
    saved = metadata.state_dict_metadata
    casts: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    for req in plan.items:
        md = saved.get(req.dest_index.fqn)
        if req.type == LoadItemType.BYTE_IO or not isinstance(md, TensorStorageMetadata):
            continue
        target = planner.resolve_tensor(req)
        if target.dtype != md.properties.dtype:
            casts[req.dest_index.fqn] = (md.properties.dtype, target.dtype)
    asked = {req.dest_index.fqn for req in plan.items}
    asked |= set(getattr(planner, "state_dict", None) or {})  # keys whose shard on this rank is empty
    unloaded = [] if partial else sorted(k for k in saved if k not in asked and not layout.is_rank_item(k))
    problems = []
    if casts:
        problems.append("tensors cast to the state dict's dtype: " + _some(
            [f"{k} ({str(a).removeprefix('torch.')} -> {str(b).removeprefix('torch.')})" for k, (a, b) in sorted(casts.items())]
        ))
    if unloaded:
        problems.append(f"{len(unloaded)} checkpoint key(s) the state dict does not load: {_some(unloaded)}")
    if not problems:
        return
    if strict:
        raise StateDictMismatchError(
            f"step {step} does not match the state dict exactly (strict=True): " + "; ".join(problems)
            + "; load with strict=False to cast and load a subset, as DCP does",
            step=step,
        )
    message = f"step {step}: " + "; ".join(problems) + " (pass strict=True to make this an error)"
    log.warning(step, "%s", message)
    warnings.warn(message, LoadMismatchWarning, stacklevel=2)


def check_expected(state_dict: dict[str, Any], metadata: Metadata, step: int) -> None:
    """Raise StateDictMismatchError when keys, shapes or kinds differ from the checkpoint."""
    flat, _ = flatten_state_dict(resolve_stateful(state_dict))
    saved = metadata.state_dict_metadata
    missing = sorted(k for k in flat if k not in saved and not layout.is_rank_item(k))
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    for key, value in flat.items():
        md = saved.get(key)
        if md is None:
            continue
        if isinstance(value, torch.Tensor):
            shape = _global_shape(value)
            if not isinstance(md, TensorStorageMetadata):
                problems.append(f"{key}: the checkpoint holds an object, the state dict a tensor")
            elif tuple(md.size) != shape:
                problems.append(f"{key}: checkpoint shape {tuple(md.size)}, state dict shape {shape}")
        elif isinstance(md, TensorStorageMetadata) and not isinstance(md, BytesStorageMetadata):
            problems.append(f"{key}: the checkpoint holds a tensor, the state dict a {type(value).__name__}")
    if problems:
        raise StateDictMismatchError(
            f"the state dict does not match step {step}: " + "; ".join(problems[:8]), step=step
        )


def _global_shape(value: torch.Tensor) -> tuple[int, ...]:
    """The shape a tensor has in the checkpoint: a DTensor's or ShardedTensor's global one."""
    if is_sharded_tensor(value):  # from its metadata: a torch op on a ShardedTensor warns (deprecated)
        return tuple(value.metadata().size)  # type: ignore[attr-defined]
    return tuple(value.shape) if isinstance(value, DTensor) else tuple(value.size())
