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

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from tierckpt._torch_compat import is_sharded_tensor
from tierckpt.config import CheckpointConfig
from tierckpt.dcp.agree import gather
from tierckpt.errors import CheckpointNotFoundError, IntegrityError, NoUsableStepError, StorageError
from tierckpt.runtime import RankRuntime
from tierckpt.tiers import open_memory
from tierckpt.tiers.peer import open_peer

__all__ = ["agree", "confirm", "localize", "write_back"]


def localize(obj: Any) -> Any:
    """The state dict with every DTensor replaced by its local shard (same storage); a ShardedTensor
    by its one local shard, or by the list of them when it has none or several on this rank."""
    if is_sharded_tensor(obj):
        shards = [s.tensor for s in obj.local_shards()]
        return shards[0] if len(shards) == 1 else shards
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


def agree(rt: RankRuntime, base: CheckpointConfig, requested: int | None, exclude: set[int],
          group: dist.ProcessGroup | None, *, before: int | None = None) -> int | None:
    """The newest step (or ``requested``) that every rank holds in some tier; None if none exists.

    ``before`` (``resume_before``; the smallest of all ranks' applies) keeps only older steps
    when no step is requested. Committed steps that exist (this rank's own, or other ranks'
    under their names in this rank's memory root) while no step is held by every rank →
    NoUsableStepError naming who holds what: never None, which means "start fresh".
    """
    mine: set[int] = {s.step for s in rt.memory.list_steps()} | _peer_steps(rt)
    if rt.durable is not None:
        try:
            mine |= {s.step for s in rt.durable.list_steps()}
        except StorageError as exc:
            rt.log.warning(None, "durable tier unavailable, using memory only: %s", exc)
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    everyone = gather(_Held(rt.rank, tuple(sorted(mine - exclude)), _foreign(base, rt.rank, world), before), group)
    if requested is not None:
        anywhere = set().union(*(h.own for h in everyone))
        if requested not in anywhere:
            raise CheckpointNotFoundError(f"step {requested} does not exist on any rank", step=requested)
        if not all(requested in h.own for h in everyone):
            raise IntegrityError(f"step {requested} is missing on some ranks (local mode)", step=requested)
        return requested
    limit = min((h.before for h in everyone if h.before is not None), default=None)
    held = [h.below(limit) for h in everyone]
    common = set(held[0].own).intersection(*(h.own for h in held[1:]))
    if common:
        return max(common)
    if any(h.own or h.foreign for h in held):
        raise _unusable(held, base.namespace)
    return None


@dataclass(frozen=True)
class _Held:
    """What one rank holds: its own committed steps, other ranks' steps in its memory root."""

    rank: int
    own: tuple[int, ...]
    foreign: dict[int, tuple[int, ...]]  # other rank → its committed steps found in this memory root
    before: int | None = None

    def below(self, limit: int | None) -> _Held:
        if limit is None:
            return self
        foreign = {r: tuple(s for s in steps if s < limit) for r, steps in self.foreign.items()}
        return _Held(self.rank, tuple(s for s in self.own if s < limit), {r: s for r, s in foreign.items() if s}, None)


def _foreign(base: CheckpointConfig, rank: int, world: int) -> dict[int, tuple[int, ...]]:
    """Committed steps other ranks saved (under their own names) into this rank's memory root."""
    out: dict[int, tuple[int, ...]] = {}
    for other in range(world):
        if other != rank:
            steps = tuple(s.step for s in open_memory(base.rank_local(other)).list_steps())
            if steps:
                out[other] = steps
    return out


def _unusable(held: list[_Held], namespace: str) -> NoUsableStepError:
    steps = sorted(set().union(*(set(h.own) | set().union(*h.foreign.values()) for h in held)))
    found, missing = [], {}
    for h in held:
        others = "".join(f", and rank {r}'s steps {_nums(s)} (namespace {namespace}--rank{r})"
                         for r, s in sorted(h.foreign.items()))
        found.append(f"rank {h.rank} holds {'steps ' + _nums(h.own) if h.own else 'no step of its own'}{others}")
    for step in steps:
        lacking = [h.rank for h in held if step not in h.own]
        missing[step] = f"ranks {_nums(lacking)} hold no copy of their own"
    return NoUsableStepError(
        f"local mode: namespace {namespace!r} has committed steps {_nums(steps)} but no step that every "
        f"rank holds under its own name: {'; '.join(found)}. To resume: {_ADVICE}",
        steps=tuple(steps), missing=missing,
    )


_ADVICE = (
    "local mode loads each rank's own files from its own memory root, a peer node's replica (the node "
    "agent, tierckpt run --replicas 1, the default on 2+ nodes) or the durable tier, so restart every "
    "rank on the node that saved them (tierckpt run keeps a node's ranks across restarts where it can), "
    "run the node agents so that a lost node's newest replicated step stays on every node, or give the "
    "job a durable tier (durable_url); to start over on purpose, use a new namespace"
)


def _nums(values: Iterable[int]) -> str:
    return ", ".join(map(str, values))


def confirm(ok: bool, group: dist.ProcessGroup | None) -> bool:
    """True when every rank loaded its shards; otherwise every rank retries."""
    return all(gather(ok, group))
