"""torchtitan: its ``CheckpointManager`` saving and loading through tierckpt's DCP plug-ins.

    from tierckpt.integrations.torchtitan import TierckptCheckpointManager
    tiers = tierckpt.CheckpointConfig(namespace="llama3-8b", durable_url="s3://bucket/ckpt",
                                      durable_every_n_steps=500)          # durable every M steps
    manager = TierckptCheckpointManager(CheckpointManager.Config(enable=True, interval=50),  # memory every N
                                        tiers=tiers, dataloader=..., model_parts=..., optimizers=...,
                                        lr_schedulers=..., states={"train_state": train_state},
                                        sd_adapter=None)
    manager.load()                      # newest step every rank can load, from the fastest tier
    manager.save(step)                  # torchtitan's own interval and async modes, into the tiers

The subclass replaces only torchtitan's storage calls, keeping its save schedule, state
flattening and async modes: ``dcp_save`` hands torchtitan's ``dcp.save`` / ``dcp.async_save``
call a ``TieredStorageWriter`` for ``step-N`` (``async_with_pinned_mem`` stages into the
shared-memory slot, which on GPU is registered as pinned memory), ``dcp_load`` a
``TieredStorageReader``, ``_find_load_step`` asks the tiers (all ranks agree on one step), and
purging is left to the tiers' retention (``memory_steps_retained``, ``durable_steps_retained``).
Hugging Face exports (``last_save_in_hf``) still go to torchtitan's folder. The functions below
are the adapter itself and need no torchtitan.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tierckpt.config import CheckpointConfig
from tierckpt.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt.errors import ConfigError, TierckptError
from tierckpt.integrations._tree import dcp_cause
from tierckpt.runtime import runtime_for

# TierckptCheckpointManager comes from __getattr__ (built on first use, so no torchtitan import here)
__all__ = ["newest_step", "tiered_load", "tiered_save", "titan_step"]

_TITAN_STEP = re.compile(r"step-(\d+)/?$")


def titan_step(checkpoint_id: str) -> int:
    """The step of torchtitan's checkpoint id (``<folder>/step-N``)."""
    found = _TITAN_STEP.search(str(checkpoint_id))
    if found is None:
        raise ConfigError(f"checkpoint id {checkpoint_id!r} is not torchtitan's '<folder>/step-N'")
    return int(found.group(1))


def tiered_save(config: CheckpointConfig, state_dict: dict[str, Any], checkpoint_id: str, *,
                mode: str = "disabled", process_group: dist.ProcessGroup | None = None) -> Any:
    """Save as torchtitan's ``dcp_save`` does, into the tiers (every rank calls).

    ``mode`` is torchtitan's async mode: "disabled" returns None once committed, "async" a
    Future of the commit, "async_with_pinned_mem" an ``AsyncSaveResponse`` whose staging part is
    done when this returns (the copy into shared memory happened inside the call).
    """
    writer = TieredStorageWriter(config, step=titan_step(checkpoint_id))
    if mode == "disabled":
        with _typed(f"saving {checkpoint_id}"):
            dcp_save(state_dict, storage_writer=writer)
        return None
    if mode not in ("async", "async_with_pinned_mem"):
        raise ConfigError(f"unknown torchtitan async mode {mode!r}; use disabled, async or async_with_pinned_mem")
    result = dcp_async_save(state_dict, storage_writer=writer, process_group=process_group)
    upload = result.upload_completion if isinstance(result, AsyncSaveResponse) else result
    if mode == "async":
        return upload
    staged: Future[None] = Future()
    staged.set_result(None)
    return AsyncSaveResponse(staging_completion=staged, upload_completion=upload)


def tiered_load(config: CheckpointConfig, state_dict: dict[str, Any], checkpoint_id: str) -> None:
    """Load ``<folder>/step-N`` in place from the fastest verified copy (every rank calls)."""
    reader = TieredStorageReader(config, step=titan_step(checkpoint_id))
    with _typed(f"loading {checkpoint_id}", reader):
        dcp_load(state_dict, storage_reader=reader)


@contextlib.contextmanager
def _typed(what: str, reader: TieredStorageReader | None = None) -> Iterator[None]:
    """DCP's CheckpointException (a BaseException) → the tierckpt error inside, or a TierckptError.

    With several ranks DCP re-wraps a read_metadata error as text; the reader keeps the original.
    """
    try:
        yield
    except CheckpointException as exc:
        cause = (reader.failure if reader is not None else None) or dcp_cause(exc)
        if isinstance(cause, TierckptError):
            raise cause from exc
        raise TierckptError(f"{what} failed: {cause}") from exc


def newest_step(config: CheckpointConfig) -> int:
    """The newest committed step every rank sees in some tier, else -1 (a collective when initialized)."""
    distributed = dist.is_available() and dist.is_initialized()
    runtime = runtime_for(config, dist.get_rank() if distributed else 0)
    tiers = [runtime.memory] + ([runtime.durable] if runtime.durable is not None else [])
    mine = {listing.step for tier in tiers for listing in tier.list_steps()}
    if distributed and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(mine))
        mine = set.intersection(*(set(steps) for steps in everyone))
    return max(mine, default=-1)


_CLASS: type | None = None


def __getattr__(name: str) -> Any:
    """``TierckptCheckpointManager`` is built on first use, so this module imports without torchtitan."""
    global _CLASS
    if name != "TierckptCheckpointManager":
        raise AttributeError(name)
    if _CLASS is None:
        _CLASS = _build()
    return _CLASS


def _build() -> type:
    try:
        from torchtitan.components.checkpoint import MODEL, CheckpointManager
    except ImportError as exc:
        raise ConfigError("the torchtitan integration needs torchtitan: pip install torchtitan") from exc

    class TierckptCheckpointManager(CheckpointManager):  # type: ignore[misc]
        """torchtitan's CheckpointManager with its storage calls going to tierckpt's tiers."""

        def __init__(self, config: Any, *, tiers: CheckpointConfig, **kwargs: Any) -> None:
            if not isinstance(tiers, CheckpointConfig):
                raise ConfigError("tiers must be a tierckpt.CheckpointConfig")
            self.tiers = tiers
            super().__init__(config, **kwargs)

        def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any,
                     enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
            if to_hf:  # a Hugging Face export of the last step: torchtitan's own folder
                return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
            mode = getattr(async_mode, "value", async_mode)
            return tiered_save(self.tiers, state_dict, checkpoint_id, mode=mode, process_group=self.pg)

        def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                     from_quantized: bool) -> None:
            if from_hf:
                super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
                return
            tiered_load(self.tiers, state_dict, checkpoint_id)
            if MODEL in self.states:  # as torchtitan does: the model state was flattened
                self.states[MODEL].load_state_dict(state_dict)

        def _find_load_step(self, folder: str = "") -> int:
            return newest_step(self.tiers) if not folder or folder == self.folder else super()._find_load_step(folder)

        def _load(self, step: int = -1) -> bool:
            load_step = self._find_load_step() if step == -1 else step
            if load_step == -1:  # nothing in the tiers: torchtitan's initial-load rules
                return bool(super()._load(step=-1))
            states = self._states_to_load(model_only=load_step == 0)  # step 0 is the seed (model only)
            self.dcp_load(states, checkpoint_id=self._create_checkpoint_id(load_step), from_hf=False,
                          from_quantized=False)
            return True

        def _purge_stale_checkpoints(self) -> None:
            return None  # retention belongs to the tiers (memory_steps_retained, durable_steps_retained)

    return TierckptCheckpointManager
