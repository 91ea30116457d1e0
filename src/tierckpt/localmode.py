"""Collective-free local mode: each rank checkpoints only its own shards.

The analogue of SageMaker model parallelism's local state dicts, for jobs so large that
DCP's planning collectives (a gather and a scatter of every rank's plan, per save) cost
seconds. Each rank's state is saved as a standard single-process DCP checkpoint in its
own namespace ``<namespace>--rank<r>``: no collective at all on save. On load one small
all_gather on a side group picks the newest step every rank holds; each rank then loads
its own shards, so the job must use the same world size and sharding as when it saved.

Call order (every rank): ``localize(state_dict)`` → stage / save as usual with
``config.rank_local(rank)``; on load ``agree(...)`` → ``dcp.load(..., no_dist=True)``
→ ``confirm(...)`` (all ranks succeeded, or all retry an older step).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from tierckpt.dcp.agree import gather
from tierckpt.errors import CheckpointNotFoundError, IntegrityError, StorageError
from tierckpt.runtime import RankRuntime
from tierckpt.tiers.peer import open_peer

__all__ = ["agree", "confirm", "localize", "write_back"]


def localize(obj: Any) -> Any:
    """The state dict with every DTensor replaced by its local shard (same storage)."""
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, Stateful) and not isinstance(obj, dict):
        return localize(obj.state_dict())
    if isinstance(obj, dict):
        return {k: localize(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [localize(v) for v in obj]
    return obj


def write_back(original: Any, loaded: Any) -> None:
    """Copy loaded non-tensor values into the caller's containers (tensors loaded in place)."""
    if isinstance(original, dict):
        for k, v in original.items():
            if isinstance(v, (DTensor,)) or hasattr(v, "data_ptr"):
                continue
            if isinstance(v, Stateful) and not isinstance(v, dict):
                v.load_state_dict(loaded[k])
            elif isinstance(v, (dict, list)):
                write_back(v, loaded[k])
            else:
                original[k] = loaded[k]
    elif isinstance(original, list):
        for i, v in enumerate(original):
            if isinstance(v, (dict, list)):
                write_back(v, loaded[i])
            elif not (isinstance(v, DTensor) or hasattr(v, "data_ptr")):
                original[i] = loaded[i]


def _peer_steps(rt: RankRuntime) -> set[int]:
    """Steps of this rank that peers hold complete (through this node's agent; none without one):
    a rank relaunched on a machine whose memory tier is empty resumes from its replica."""
    peer = open_peer(rt.config.memory_dir, rt.config.namespace)
    if peer is None:
        return set()
    try:
        catalog = peer.catalog()
    except (StorageError, ValueError, KeyError, TypeError) as exc:
        rt.log.warning(None, "the node agent cannot list peers, loading without them: %s", exc)
        return set()
    return {step for step, entry in catalog.items() if entry.all_files and entry.all_files <= set(entry.held)}


def agree(rt: RankRuntime, requested: int | None, exclude: set[int], group: dist.ProcessGroup | None) -> int | None:
    """The newest step (or ``requested``) that every rank holds in some tier; None if none."""
    mine: set[int] = {s.step for s in rt.memory.list_steps()} | _peer_steps(rt)
    if rt.durable is not None:
        try:
            mine |= {s.step for s in rt.durable.list_steps()}
        except StorageError as exc:
            rt.log.warning(None, "durable tier unavailable, using memory only: %s", exc)
    everyone = gather(sorted(mine - exclude), group)
    common = set(everyone[0]).intersection(*everyone[1:]) if everyone else set()
    anywhere = set().union(*everyone) if everyone else set()
    if requested is not None:
        if requested not in anywhere:
            raise CheckpointNotFoundError(f"step {requested} does not exist on any rank", step=requested)
        if requested not in common:
            raise IntegrityError(f"step {requested} is missing on some ranks (local mode)", step=requested)
        return requested
    return max(common) if common else None


def confirm(ok: bool, group: dist.ProcessGroup | None) -> bool:
    """True when every rank loaded its shards; otherwise every rank retries."""
    return all(gather(ok, group))
