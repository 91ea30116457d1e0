"""``Checkpointer``: save, load and list steps across tiers, with the durable copy in the background.

Call order (every rank, same order, same arguments):
  ck = Checkpointer(config)          one all_gather to learn which ranks share a node
  step = ck.load(state_dict)         agreed step loaded in place, or None when nothing exists
                                     (steps that exist but no rank set can load:
                                     NoUsableStepError; after a non-finite loss at step N,
                                     config.resume_before = N: the newest step older than N)
  ck.register_fence(optimizer)       optional, once: the optimizer's step waits for an
                                     overlapped save's copy (a module: its forward does)
  ck.reserve(state_dict)             optional: allocate the slots ahead of the first save
  handle = ck.save(step, state_dict) returns once the state is copied into shared memory
                                     (the only part that blocks training); a background
                                     committer then plans (cached), checksums and commits the
                                     step in memory; a durable copy (config policy or
                                     durable=True) drains after that in a second thread.
                                     One save is in flight per rank: the next save waits for
                                     the previous memory commit. With overlap=True it returns
                                     before the copy: nothing may change the tensors before
                                     the fence (a registered optimizer's next step,
                                     handle.wait_staged(), ck.fence(), or any later save,
                                     load, wait or close).
  ck.wait()                          every save so far committed (and durable when asked)
  ck.close()                         waits, then releases slots and threads
The parts live in their own modules: ``topology`` (node membership, side groups),
``savepath`` (stage and commit), ``drain`` (the durable queue), ``loading`` (load).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from tierckpt import layout, localmode, metrics
from tierckpt.config import CheckpointConfig
from tierckpt.drain import DrainQueue
from tierckpt.errors import ConfigError, TierckptError
from tierckpt.handles import SaveHandle, StepInfo
from tierckpt.loading import Loader
from tierckpt.observability import StepLogger
from tierckpt.policy import DurablePolicy
from tierckpt.runtime import RankRuntime
from tierckpt.savepath import SavePath
from tierckpt.snapshot import resolve_stateful
from tierckpt.topology import NodeTopology

__all__ = ["Checkpointer", "SaveHandle", "StepInfo"]


class Checkpointer:
    """Tiered checkpointing for one namespace; a context manager that closes on exit."""

    def __init__(self, config: CheckpointConfig, *, process_group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(config, CheckpointConfig):
            raise ConfigError("config must be a tierckpt.CheckpointConfig")
        self.config = config
        self.group = process_group
        self.topology = topo = NodeTopology(config, process_group)
        self.distributed, self.rank, self.world_size = topo.distributed, topo.rank, topo.world_size
        self.node_leader, self.shares_coordinator_node = topo.node_leader, topo.shares_coordinator_node
        self.multi_node = topo.multi_node
        self.local = config.local_mode
        self.runtime = RankRuntime(config.rank_local(self.rank) if self.local else config, self.rank)
        self.log = StepLogger("checkpointer", self.rank, config.logger)
        self.policy = DurablePolicy(config.durable_every_n_steps, config.durable_url is not None)
        drains = None
        if config.durable_url is not None:
            drains = DrainQueue(self.runtime, self.log, rank=self.rank, world_size=self.world_size,
                                group=topo.drain_group, coordinator=self.rank == 0 or self.local)
        self._drains = drains
        self._save = SavePath(self.runtime, topo, drains, self.log, local=self.local)
        self._loader = Loader(config, self.runtime, self.log,
                              group=process_group, agree_group=topo.commit_group)
        self._closed = False
        self._clean_leftovers()
        metrics.enable_from_env()  # TIERCKPT_METRICS_PORT: serve the library's metrics

    def _clean_leftovers(self) -> None:
        """Free slots held by saves that died with their process, and torn durable copies."""
        if self.node_leader:
            removed = self.runtime.memory.gc_staging()
            if removed:
                self.log.info(None, "removed %d leftover(s) of dead processes from memory: %s", len(removed), removed)
        if self.rank == 0 or self.local:  # each rank owns its durable tier in local mode
            durable_gc = getattr(self.runtime.durable, "gc_staging", None)
            if durable_gc is not None:
                try:
                    removed = durable_gc()
                    if removed:
                        self.log.info(None, "removed %d torn durable copies of dead processes: %s", len(removed), removed)
                except TierckptError as exc:
                    self.log.warning(None, "could not clean the durable tier: %s", exc)

    @property
    def last_load(self) -> dict[str, Any]:
        """The latest successful load: step, seconds, tiers, and the (step, reason) pairs skipped."""
        return self._loader.last_load

    # -- context ----------------------------------------------------------------------
    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(raise_errors=exc[0] is None)

    def close(self, *, raise_errors: bool = True) -> None:
        if self._closed:
            return
        try:
            if raise_errors:
                self.wait()
        finally:
            self._closed = True
            self._save.close()
            if self._drains is not None:
                self._drains.close()
            self.runtime.close()

    # -- save -------------------------------------------------------------------------
    def save(self, step: int, state_dict: dict[str, Any], durable: bool | None = None, *,
             overlap: bool = False, check_snapshot: bool = False) -> SaveHandle:
        """Copy ``state_dict`` into shared memory and return; commit and drain in the background.

        ``overlap=True`` returns before the tensor data is copied (a CPU thread, or a CUDA
        side stream into the pinned slot) and the checkpoint still holds the values at this
        call, provided nothing changes them before the fence: ``register_fence(optimizer)``
        makes the optimizer's next step wait, ``handle.wait_staged()`` and ``fence()`` wait
        explicitly, and every later save, load, wait and close does too. ``check_snapshot``
        (debug mode, costs a hash of the state at the call) detects a change before the fence:
        the handle then fails with ``SnapshotChangedError`` naming the key.

        A save made after a non-finite ``tierckpt.monitor.step`` (and before a finite one), or
        whose commit is still running when a non-finite ``monitor.step`` of its step or an
        earlier one arrives, is committed on no rank: ``handle.skipped`` says why, with a
        warning; the handle and ``wait`` do not raise.
        """
        self._check_open()
        layout.validate_step(step)
        if durable and self.config.durable_url is None:
            raise ConfigError("durable=True but the config has no durable_url")
        return self._save.save(step, state_dict, self.policy.should_save(step, durable), overlap=overlap,
                               check_snapshot=check_snapshot)

    def fence(self) -> None:
        """Wait for the copy of an overlapped save (CUDA: make the current stream wait for it).

        Never raises: a failed copy is reported by the save's handle and ``wait``.
        """
        self._save.fence()

    def register_fence(self, target: torch.optim.Optimizer | torch.nn.Module) -> RemovableHandle:
        """Fence an optimizer's ``step`` (a step pre-hook) or a module's forward (a forward pre-hook).

        Register the optimizer that updates the saved parameters and state, and any module
        whose forward changes saved buffers in place (BatchNorm's running statistics).
        ``.remove()`` on the returned handle unregisters it.
        """
        if isinstance(target, torch.optim.Optimizer):
            return target.register_step_pre_hook(lambda *_: self._save.fence())
        if isinstance(target, torch.nn.Module):
            return target.register_forward_pre_hook(lambda *_: self._save.fence())
        raise ConfigError(f"register_fence takes a torch.optim.Optimizer or torch.nn.Module, not {type(target).__name__}")

    def reserve(self, state_dict: dict[str, Any], *, wait: bool = False) -> Future[int]:
        """Allocate and fault in the shared-memory slots that saves of ``state_dict`` will use.

        Runs in the background (``wait=True`` blocks until done) within memory_budget_bytes;
        the future gives the number of slots added. Saves do this by themselves after the
        first one; calling it early makes the first save warm too.
        """
        self._check_open()
        sd = localmode.localize(state_dict) if self.local else resolve_stateful(state_dict)
        future = self._save.reserve(self.runtime.stager.nbytes_of(sd))
        if wait:
            future.result()
        return future

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far finished; raise the first failure."""
        self._save.wait(timeout)

    # -- load -------------------------------------------------------------------------
    def load(
        self, state_dict: dict[str, Any], step: int | None = None, *, strict: bool = False, trusted: bool | None = None
    ) -> int | None:
        """Load the newest loadable step (or ``step``) in place; None when nothing exists.

        Committed steps that exist but that no rank set can load raise ``NoUsableStepError``
        (never None). Without ``step``, and before this Checkpointer's first save,
        ``config.resume_before`` (``TIERCKPT_RESUME_BEFORE``, set by ``tierckpt run`` after a
        non-finite loss) keeps only older steps.

        ``strict=True`` refuses dtype casts and checkpoint keys the state dict does not load
        (StateDictMismatchError; by default each is a warning). ``trusted`` overrides the
        config's: True unpickles the checkpoint's objects without the allow-list.
        """
        self._check_open()
        if step is not None:
            layout.validate_step(step)
        self._save.settle()  # a load after a save sees that save and its durable copy
        # the bound is for resuming: once this job saved again (held back while non-finite), its steps count
        before = self.config.resume_before if step is None and self._save.saves_made == 0 else None
        return self._loader.load(state_dict, step, strict=strict, trusted=trusted, resume_before=before)

    def steps(self) -> list[StepInfo]:
        """Committed steps this rank can see, oldest first, with the tiers that hold them."""
        seen: dict[int, set[str]] = {}
        tiers = [self.runtime.memory] + ([self.runtime.durable] if self.runtime.durable else [])
        for tier in tiers:
            for listing in tier.list_steps():
                seen.setdefault(listing.step, set()).add(tier.name)
        return [StepInfo(s, frozenset(t)) for s, t in sorted(seen.items())]

    def _check_open(self) -> None:
        if self._closed:
            raise TierckptError("this Checkpointer is closed")
