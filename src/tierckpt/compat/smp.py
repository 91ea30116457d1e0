"""SageMaker model parallelism (SMP v2)'s checkpoint calls, running on tierckpt (seed 003).

Code written for ``torch.sagemaker.distributed.checkpoint`` keeps its calls, with the names
imported from here instead:

    from tierckpt.compat.smp import (async_save, maybe_finalize_async_calls, load, init_optim_state,
                                     get_global_ranks, DistributedFileSystemReader, replication_groups)
    maybe_finalize_async_calls(blocking=True, process_group=group)
    async_save(state_dict, checkpoint_id=os.path.join(save_dir, sub_dir),     # or "s3://bucket/key"
               process_group=group, coordinator_rank=min(get_global_ranks(group)))
    load(state_dict, process_group=group, coordinator_rank=...,
         storage_reader=DistributedFileSystemReader(checkpoint_id))

Mapping: ``checkpoint_id`` ``<dir>/<name>`` is a tierckpt namespace ``<name>`` (letters, digits,
``-``, ``_``) whose durable tier is ``<dir>`` (a path, ``file://`` or ``s3://bucket/prefix``):
each save is one step, ``<dir>/<name>/step_<N>/`` (plain DCP, manifest, ``COMMITTED`` last),
committed to the node's memory tier first, then the durable one; once it is durable the older
step there is removed, so a checkpoint_id holds one checkpoint, as with SMP, but is never torn.
``N`` is 1 + the newest step the coordinator finds (``step=`` overrides it). The memory tier of a
checkpoint_id is a root of its own (``<memory root>-smp/<hash of checkpoint_id>``), so two
checkpoint_ids with the same last component never mix. ``load`` reads the newest step every rank
of the group can load, memory first.

Replication groups (SMP's local checkpoints): each group saves its own checkpoint_id with its
own ``process_group`` and the group's lowest rank as ``coordinator_rank`` (DCP coordinates on
the group's first rank; another rank is a ConfigError). Replicas hold identical shards, so DCP
writes each item once per group; a group of another size (a different replica count) loads it,
as long as the shard degree, hence each group's checkpoint_id, is unchanged.

``async_save`` futures are kept per process for ``maybe_finalize_async_calls`` (SMP's API has no
handle either). Call order, every rank of a group: ``maybe_finalize_async_calls`` →
``async_save`` (the coordinator picks the step, one broadcast) → ... → ``load``.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tierckpt.config import (
    DEFAULT_MEMORY_DIR,
    CheckpointConfig,
    S3Settings,
    launcher_settings,
    validate_namespace,
)
from tierckpt.dcp.reader import TieredStorageReader
from tierckpt.dcp.writer import TieredStorageWriter
from tierckpt.errors import ConfigError
from tierckpt.tiers import open_durable, open_memory

__all__ = [
    "DistributedFileSystemReader",
    "async_save",
    "config_for",
    "get_global_ranks",
    "init_optim_state",
    "load",
    "maybe_finalize_async_calls",
    "replication_groups",
    "save",
]

_pending: list[Future[Any]] = []  # this process's async saves, for maybe_finalize_async_calls


def config_for(checkpoint_id: str | os.PathLike[str], *, memory_dir: str | None = None,
               s3: S3Settings | None = None) -> CheckpointConfig:
    """The tierckpt config a checkpoint_id stands for (see the module docstring)."""
    text = os.fspath(checkpoint_id).rstrip("/")
    if text.startswith("s3://"):
        parent, _, name = text.rpartition("/")
        if parent == "s3:/" or not parent[len("s3://"):]:
            raise ConfigError(f"checkpoint_id {text!r} needs a bucket and a name: 's3://bucket/[prefix/]name'")
        durable, key = parent, text
    else:
        path = os.path.abspath(text[len("file://"):] if text.startswith("file://") else text)
        parent, name = os.path.dirname(path), os.path.basename(path)
        durable, key = f"file://{parent}", path
    try:
        validate_namespace(name)
    except ConfigError as exc:
        raise ConfigError(f"checkpoint_id {text!r}: its last component is the namespace: {exc}") from None
    root = (memory_dir or launcher_settings().get("memory_dir") or DEFAULT_MEMORY_DIR).rstrip("/")
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return CheckpointConfig(namespace=name, memory_dir=f"{root}-smp/{digest}", durable_url=durable,
                            memory_steps_retained=1, durable_every_n_steps=0, durable_steps_retained=1,
                            s3=s3 or S3Settings())


def get_global_ranks(process_group: dist.ProcessGroup | None = None) -> list[int]:
    """The global ranks of ``process_group`` (every rank for None), ascending: SMP's helper."""
    if not (dist.is_available() and dist.is_initialized()):
        return [0]
    if process_group is None:
        return list(range(dist.get_world_size()))
    return sorted(dist.get_process_group_ranks(process_group))


def replication_groups(world_size: int, shard_degree: int) -> list[list[int]]:
    """The ranks holding the same shard, for ranks laid out replica-major (rank = replica *
    shard_degree + shard): what SMP's ``state.ranker.get_rep_groups()`` returns for such a job."""
    if isinstance(shard_degree, bool) or not isinstance(shard_degree, int) or shard_degree < 1 \
            or world_size % shard_degree:
        raise ConfigError(f"shard_degree must be a whole divisor of the world size {world_size}, got {shard_degree!r}")
    return [list(range(s, world_size, shard_degree)) for s in range(shard_degree)]


def _check_coordinator(process_group: dist.ProcessGroup | None, coordinator_rank: int) -> None:
    first = get_global_ranks(process_group)[0]
    if coordinator_rank != first:
        raise ConfigError(
            f"coordinator_rank={coordinator_rank} but DCP coordinates on the group's lowest rank, {first}: pass "
            "coordinator_rank=min(get_global_ranks(process_group)), as SMP's examples do"
        )


def _next_step(config: CheckpointConfig, process_group: dist.ProcessGroup | None, coordinator_rank: int) -> int:
    """1 + the newest step of the checkpoint_id the coordinator sees (0 for a new one), shared by the group."""
    box: list[Any] = [None]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == coordinator_rank:
        steps = [s.step for s in open_memory(config).list_steps()]
        durable = open_durable(config)
        if durable is not None:
            try:
                steps += [s.step for s in durable.list_steps()]
            finally:
                closer = getattr(durable, "close", None)
                if closer is not None:
                    closer()
        box[0] = max(steps, default=-1) + 1
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(box, src=coordinator_rank, group=process_group)
    return int(box[0])


def _writer(checkpoint_id: Any, process_group: dist.ProcessGroup | None,
            coordinator_rank: int, step: int | None, memory_dir: str | None, s3: S3Settings | None) -> TieredStorageWriter:
    if checkpoint_id is None:
        raise ConfigError("checkpoint_id is required: the directory (or s3://bucket/key) this checkpoint goes to")
    _check_coordinator(process_group, coordinator_rank)
    config = config_for(checkpoint_id, memory_dir=memory_dir, s3=s3)
    chosen = _next_step(config, process_group, coordinator_rank) if step is None else step
    return TieredStorageWriter(config, step=chosen, durable=True)


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
               process_group: dist.ProcessGroup | None = None, coordinator_rank: int = 0,
               step: int | None = None, memory_dir: str | None = None, s3: S3Settings | None = None,
               **unsupported: Any) -> Future[Any]:
    """Save ``state_dict`` to ``checkpoint_id`` in the background (returns once it is staged)."""
    _refuse(unsupported, "async_save")
    writer = _writer(checkpoint_id, process_group, coordinator_rank, step, memory_dir, s3)
    future: Future[Any] = dcp_async_save(state_dict, storage_writer=writer, process_group=process_group)  # type: ignore[assignment]
    _pending.append(future)
    return future


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
         process_group: dist.ProcessGroup | None = None, coordinator_rank: int = 0,
         step: int | None = None, memory_dir: str | None = None, s3: S3Settings | None = None) -> int:
    """Save ``state_dict`` to ``checkpoint_id`` now; returns the step it became."""
    writer = _writer(checkpoint_id, process_group, coordinator_rank, step, memory_dir, s3)
    dcp_save(state_dict, storage_writer=writer, process_group=process_group)
    return writer.step


def maybe_finalize_async_calls(blocking: bool = True, process_group: dist.ProcessGroup | None = None) -> None:
    """Wait for (``blocking``) or collect the finished ``async_save`` calls of this process; the
    first failure is raised once every waited-for save has ended. ``process_group`` is accepted for
    SMP's signature: saves are this process's own."""
    done = [f for f in _pending if blocking or f.done()]
    for future in done:
        _pending.remove(future)
    errors = [f.exception() for f in done]
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        raise failed


class DistributedFileSystemReader(TieredStorageReader):
    """SMP's reader of a checkpoint_id: the newest step of it every rank of the group can load."""

    def __init__(self, checkpoint_id: str | os.PathLike[str], *, process_group: dist.ProcessGroup | None = None,
                 step: int | None = None, memory_dir: str | None = None, s3: S3Settings | None = None) -> None:
        super().__init__(config_for(checkpoint_id, memory_dir=memory_dir, s3=s3), step=step, process_group=process_group)
        self.checkpoint_id = os.fspath(checkpoint_id)

    def reset(self, checkpoint_id: Any = None) -> None:
        """The checkpoint_id was given at construction; DCP's is ignored (it names no step here)."""


def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
         storage_reader: Any = None, process_group: dist.ProcessGroup | None = None,
         coordinator_rank: int = 0, planner: Any = None, memory_dir: str | None = None,
         s3: S3Settings | None = None, **unsupported: Any) -> None:
    """Load ``checkpoint_id`` (or ``storage_reader``'s) into ``state_dict`` in place."""
    _refuse(unsupported, "load")
    _check_coordinator(process_group, coordinator_rank)
    if storage_reader is None:
        if checkpoint_id is None:
            raise ConfigError("load needs checkpoint_id= or storage_reader=DistributedFileSystemReader(checkpoint_id)")
        storage_reader = DistributedFileSystemReader(checkpoint_id, process_group=process_group,
                                                     memory_dir=memory_dir, s3=s3)
    elif isinstance(storage_reader, TieredStorageReader) and storage_reader.group is None:
        storage_reader.group = process_group
        if process_group is not None:
            storage_reader.rank = dist.get_rank(process_group)
    dcp_load(state_dict, storage_reader=storage_reader, planner=planner, process_group=process_group)


def init_optim_state(optimizer: torch.optim.Optimizer, skip_empty_param: bool = False) -> None:
    """Create the optimizer's state (Adam's step and moments, SGD's momentum) so a load has tensors
    to fill: one step at learning rate 0 on zero gradients. Parameters are not moved; the previous
    gradients and learning rates are put back; ``skip_empty_param`` leaves empty parameters without state."""
    params = [p for g in optimizer.param_groups for p in g["params"]
              if p.requires_grad and p not in optimizer.state and not (skip_empty_param and p.numel() == 0)]
    if not params:
        return
    grads = {p: p.grad for g in optimizer.param_groups for p in g["params"]}
    lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for g in optimizer.param_groups:
            for p in g["params"]:
                p.grad = None
            g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
        for p in params:
            p.grad = torch.zeros_like(p)
        with torch.no_grad():
            optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr
        for p, grad in grads.items():
            p.grad = grad


def _refuse(unsupported: dict[str, Any], name: str) -> None:
    if unsupported:
        raise ConfigError(f"{name}() does not take {', '.join(sorted(unsupported))} here (SMP options tierckpt "
                          "does not map); checkpoint_id, process_group and coordinator_rank are the mapped ones")

