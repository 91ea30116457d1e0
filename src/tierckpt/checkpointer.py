"""``Checkpointer``: save, load and list steps across tiers, with the durable copy in the background.

Call order (every rank, same order, same arguments):
  ck = Checkpointer(config)          one all_gather to learn which ranks share a node
  step = ck.load(state_dict)         agreed step loaded in place, or None when nothing exists
  handle = ck.save(step, state_dict) returns once the state is copied into shared memory
                                     (the only part that blocks training); a background
                                     committer then plans (cached), checksums and commits the
                                     step in memory; a durable copy (config policy or
                                     durable=True) drains after that in a second thread.
                                     One save is in flight per rank: the next save waits for
                                     the previous memory commit.
  ck.wait()                          every save so far committed (and durable when asked)
  ck.close()                         waits, then releases slots and threads
Background commits and drains run their collectives on two dedicated gloo groups, never on
the training group, in the same order on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tierckpt import layout, localmode, monitor
from tierckpt.config import CheckpointConfig
from tierckpt.dcp.reader import TieredStorageReader
from tierckpt.dcp.writer import TieredStorageWriter
from tierckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    DurableWriteError,
    IntegrityError,
    StateDictMismatchError,
    TierckptError,
)
from tierckpt.observability import StepLogger, throughput
from tierckpt.policy import DurablePolicy
from tierckpt.runtime import RankRuntime
from tierckpt.snapshot import Snapshot, resolve_stateful

__all__ = ["Checkpointer", "SaveHandle", "StepInfo"]


@dataclass(frozen=True)
class StepInfo:
    """A step and the tiers (as this rank sees them) that hold a committed copy."""

    step: int
    tiers: frozenset[str]


class SaveHandle:
    """The result of ``Checkpointer.save``: staged and in memory at once; durable later."""

    def __init__(self, step: int, durable: bool, blocking_s: float) -> None:
        self.step = step
        self.durable = durable
        self.blocking_s = blocking_s  #: seconds ``save`` blocked (the copy into shared memory)
        self.staged = True  #: the state is copied: the caller may change its tensors now
        self._memory: Future[None] = Future()
        self._future: Future[None] = Future()

    def memory_committed(self, timeout: float | None = None) -> None:
        """Wait until the step is committed in the memory tier; re-raise a failure."""
        self._memory.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> None:
        """Wait for the save to finish everywhere it was asked to go; re-raise its error."""
        self._future.result(timeout)

    wait = result

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None


class Checkpointer:
    """Tiered checkpointing for one namespace; a context manager that closes on exit."""

    def __init__(self, config: CheckpointConfig, *, process_group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(config, CheckpointConfig):
            raise ConfigError("config must be a tierckpt.CheckpointConfig")
        self.config = config
        self.group = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        self.local = config.local_mode
        self.runtime = RankRuntime(config.rank_local(self.rank) if self.local else config, self.rank)
        self.log = StepLogger("checkpointer", self.rank, config.logger)
        self.policy = DurablePolicy(config.durable_every_n_steps, config.durable_url is not None)
        self._planner = DefaultSavePlanner(enable_plan_caching=True)
        self._handles: list[SaveHandle] = []
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="tierckpt-commit")
        self._drainer = ThreadPoolExecutor(1, thread_name_prefix="tierckpt-drain")
        self._inflight: Future[None] | None = None
        self._drains: list[Future[None]] = []  # running or queued durable copies, oldest first
        self._saves = 0  # saves committed by this Checkpointer: the same count on every rank
        self._closed = False
        self.node_leader, self.shares_coordinator_node = True, True
        self._commit_group: dist.ProcessGroup | None = None
        self._drain_group: dist.ProcessGroup | None = None
        if self.distributed and self.world_size > 1 and self.local:
            # one side group, used only by load's agreement: saves need no collective at all
            ranks = dist.get_process_group_ranks(process_group) if process_group else None
            self._commit_group = dist.new_group(ranks=ranks, backend="gloo")
            self.multi_node = False
        elif self.distributed and self.world_size > 1:
            me = (socket.gethostname(), os.path.realpath(config.memory_dir))
            nodes: list[Any] = [None] * self.world_size
            dist.all_gather_object(nodes, me, group=process_group)
            self.node_leader = nodes.index(me) == self.rank
            self.shares_coordinator_node = nodes[0] == me
            self.multi_node = len(set(nodes)) > 1
            ranks = dist.get_process_group_ranks(process_group) if process_group else None
            self._commit_group = dist.new_group(ranks=ranks, backend="gloo")
            if config.durable_url is not None:
                self._drain_group = dist.new_group(ranks=ranks, backend="gloo")
        else:
            self.multi_node = False
        if self.node_leader:  # saves that died with their process hold slots: free them
            removed = self.runtime.memory.gc_staging()
            if removed:
                self.log.info(None, "removed %d leftover(s) of dead processes from memory: %s", len(removed), removed)
        if self.rank == 0 or self.local:  # and torn durable copies (each rank owns its tier in local mode)
            durable_gc = getattr(self.runtime.durable, "gc_staging", None)
            if durable_gc is not None:
                try:
                    removed = durable_gc()
                    if removed:
                        self.log.info(None, "removed %d torn durable copies of dead processes: %s", len(removed), removed)
                except TierckptError as exc:
                    self.log.warning(None, "could not clean the durable tier: %s", exc)
        self.last_load: dict[str, Any] = {}

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
            self._committer.shutdown(wait=True)
            self._drainer.shutdown(wait=True)
            self.runtime.close()

    # -- save -------------------------------------------------------------------------
    def save(self, step: int, state_dict: dict[str, Any], durable: bool | None = None) -> SaveHandle:
        """Copy ``state_dict`` into shared memory and return; commit and drain in the background."""
        self._check_open()
        layout.validate_step(step)
        if durable and self.config.durable_url is None:
            raise ConfigError("durable=True but the config has no durable_url")
        go_durable = self.policy.should_save(step, durable)
        self._wait_inflight(step)
        t0 = time.perf_counter()
        if self.local:
            snap = self.runtime.stager.stage(localmode.localize(state_dict))
        else:
            snap = self.runtime.stager.stage(resolve_stateful(state_dict))
        snap.wait_copied()
        blocking = time.perf_counter() - t0
        monitor.beat()  # a long save is progress, not a hang (tierckpt run)
        self.log.info(step, "staged %d bytes in shared memory in %s; committing in the background",
                      snap.nbytes, throughput(snap.nbytes, blocking))
        handle = SaveHandle(step, go_durable, blocking)
        self._inflight = self._committer.submit(self._commit, step, snap, go_durable, handle)
        self._handles = [h for h in self._handles if not h.done()] + [handle]
        return handle

    def _wait_inflight(self, step: int | None) -> None:
        inflight = self._inflight
        if inflight is not None and not inflight.done():
            self.log.info(step, "waiting for the previous save to commit (one save in flight per rank)")
        if inflight is not None:
            inflight.exception()  # failures belong to that save's handle

    def _commit(self, step: int, snap: Snapshot, go_durable: bool, handle: SaveHandle) -> None:
        writer = TieredStorageWriter(self.runtime.config, step=step, durable=False, _runtime=self.runtime)
        writer._snapshot = snap
        writer._commit_nodes = False  # _commit_other_nodes broadcasts on the commit group instead
        self._saves += 1
        writer._save_seq = self._saves
        try:
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    if self.local:  # this rank's shards alone, as one single-process checkpoint
                        dcp_save(snap.state_dict, storage_writer=writer, planner=self._planner, no_dist=True)
                    else:
                        dcp_save(snap.state_dict, storage_writer=writer, planner=self._planner,
                                 process_group=self._commit_group)
            except CheckpointException as exc:
                raise _unwrap(exc) from None
            small = self._commit_other_nodes(writer)
        except BaseException as exc:
            if writer._snapshot is not None:  # failed before write_data took the slot
                self.runtime.stager.release(snap)
            self.log.warning(step, "save failed: %s", exc)
            handle._memory.set_exception(exc)
            handle._future.set_exception(exc)
            return
        handle._memory.set_result(None)
        if not go_durable:
            handle._future.set_result(None)
            return
        assert writer._plan_data is not None
        self._bound_drain_queue(step)
        pins = [self._pin(step, name, writer._plan_data.save_id) for name in writer.files_written]
        future = self._drainer.submit(self._drain, step, writer._plan_data, pins, small)
        future.add_done_callback(lambda f: _chain(f, handle._future))
        self._drains.append(future)

    def _bound_drain_queue(self, step: int) -> None:
        """Back-pressure: at most one durable copy running and one queued.

        Each queued copy pins a whole slot, so an unbounded queue behind a slow durable
        tier would grow shared memory by one step per save. Waiting here holds up the next
        save, identically on every rank (dropping queued copies instead could differ between
        ranks, whose drains run collectives together).
        """
        self._drains = [f for f in self._drains if not f.done()]
        if len(self._drains) >= 2:
            self.log.warning(step, "durable tier slower than saves: waiting for the copy of an earlier "
                             "step (raise durable_every_n_steps to avoid this stall)")
            while len(self._drains) >= 2:
                self._drains[0].exception()
                self._drains = [f for f in self._drains if not f.done()]

    def _commit_other_nodes(self, writer: TieredStorageWriter) -> tuple[bytes, bytes] | None:
        """Make the step visible in every node's memory tier, not just the coordinator's."""
        small = writer.committed
        if not self.multi_node:
            return small
        box = [small]
        group = self._commit_group
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        small = box[0]
        assert small is not None and writer._plan_data is not None
        if self.node_leader and not self.shares_coordinator_node:
            md, mf = small
            rt = self.runtime
            rt.memory.commit(writer.step, writer._plan_data.save_id, {layout.METADATA: md, layout.MANIFEST: mf})
            rt.committed_in_memory(writer.step)
            rt.apply_retention(rt.memory, rt.memory_retention)
        return small

    def _pin(self, step: int, name: str, save_id: str) -> tuple[str, str]:
        """Pin a data file so retention cannot recycle its slot before the drain copied it."""
        pin = self.runtime.memory.pin(step, name)
        return name, str(pin) if pin is not None else ""

    def _drain(self, step: int, pd: Any, pins: list[tuple[str, str]], small: tuple[bytes, bytes] | None) -> None:
        rt, durable = self.runtime, self.runtime.durable
        assert durable is not None
        error: str | None = None
        t0 = time.perf_counter()
        nbytes = 0  # this rank's share
        try:
            for name, pin in pins:
                if not os.path.exists(pin):
                    raise DurableWriteError(f"{name} of step {step} vanished from the memory tier before its drain")
                nbytes += os.path.getsize(pin)
                durable.put_file(step, pd.save_id, name, Path(pin))
        except Exception as exc:  # reported to every rank below, then raised on the handle
            error = f"rank {self.rank}: {exc}"
        finally:
            for _, pin in pins:
                if pin:
                    self.runtime.memory.unpin(Path(pin))
        errors = [error]
        if self._drain_group is not None:
            errors = [None] * self.world_size
            dist.all_gather_object(errors, error, group=self._drain_group)
        failed = [e for e in errors if e]
        if not failed and (self.rank == 0 or self.local):
            try:
                assert small is not None
                durable.commit(step, pd.save_id, {layout.METADATA: small[0], layout.MANIFEST: small[1]})
                rt.apply_retention(durable, rt.durable_retention)
            except Exception as exc:
                failed = [f"commit: {exc}"]
        if self._drain_group is not None:
            box = [failed]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self._drain_group, 0), group=self._drain_group)
            failed = box[0]
        if failed:
            self.log.warning(step, "durable copy failed: %s", "; ".join(failed))
            raise DurableWriteError(
                f"durable copy of step {step} failed (its memory copy is intact): " + "; ".join(failed),
                tier="durable", step=step,
            )
        self.log.info(step, "Durable write completed in %s (%s)", throughput(nbytes, time.perf_counter() - t0),
                      durable.location(step))

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far finished; raise the first failure."""
        first: BaseException | None = None
        for handle in list(self._handles):
            try:
                handle.result(timeout)
            except BaseException as exc:
                first = first or exc
        self._handles = []
        if first is not None:
            raise first

    # -- load -------------------------------------------------------------------------
    def load(
        self, state_dict: dict[str, Any], step: int | None = None, *, strict: bool = False, trusted: bool | None = None
    ) -> int | None:
        """Load the newest loadable step (or ``step``) in place; None when nothing exists.

        ``strict=True`` refuses dtype casts and checkpoint keys the state dict does not load
        (StateDictMismatchError; by default each is a warning). ``trusted`` overrides the
        config's: True unpickles the checkpoint's objects without the allow-list.
        """
        self._check_open()
        if step is not None:
            layout.validate_step(step)
        self._wait_inflight(step)  # a load after a save sees that save
        for h in self._handles:  # ... and its durable copy
            h._future.exception()
        checks: dict[str, Any] = {"strict": strict, "trusted": trusted, "verify_ahead": False}  # checked while read
        if self.local:
            return self._load_local(state_dict, step, checks)
        excluded: list[int] = []
        failures: list[tuple[int, str]] = []
        while True:
            reader = TieredStorageReader(
                self.config, step, process_group=self.group, exclude_steps=excluded,
                expect=state_dict, _runtime=self.runtime, **checks,
            )
            t0 = time.perf_counter()
            try:
                with warnings.catch_warnings(), _quiet_dcp_fallback():
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp_load(state_dict, storage_reader=reader, process_group=self.group)
            except CheckpointException as exc:
                err = reader.failure or _unwrap(exc)
                if isinstance(err, CheckpointNotFoundError) and step is None and not excluded:
                    self.log.info(None, "no checkpoint found; starting fresh")
                    return None
                if isinstance(err, CheckpointNotFoundError) and excluded:  # every step there was failed
                    raise IntegrityError("no step loads: " + "; ".join(f"step {s}: {r}" for s, r in failures)) from err
                if isinstance(err, IntegrityError) and step is None and reader.step is not None:
                    self.log.warning(reader.step, "failed to load (%s); trying an older step", err)
                    excluded.append(reader.step)
                    failures.append((reader.step, f"failed to load: {err}"))
                    continue
                raise err from None
            self.last_load = {
                "step": reader.step, "seconds": time.perf_counter() - t0,
                "tiers": sorted(set(reader.tiers_used.values())),
                "skipped": failures + [tuple(s) for s in reader.skipped],  # (step, reason) pairs
            }
            self.log.info(reader.step, "loaded in %.3fs from %s", self.last_load["seconds"], self.last_load["tiers"])
            return reader.step

    def _load_local(self, state_dict: dict[str, Any], step: int | None, checks: dict[str, Any]) -> int | None:
        """Local mode: agree on a step every rank holds, then each rank reads only its own shards."""
        local_sd = localmode.localize(state_dict)
        excluded: set[int] = set()
        while True:
            chosen = localmode.agree(self.runtime, step, excluded, self._commit_group)
            if chosen is None:
                if excluded:
                    raise IntegrityError(f"no step loads on every rank; failed: {sorted(excluded)}")
                self.log.info(None, "no checkpoint found; starting fresh")
                return None
            reader = TieredStorageReader(self.runtime.config, chosen, expect=local_sd, single_process=True,
                                         _runtime=self.runtime, **checks)
            t0, error = time.perf_counter(), None
            try:
                with warnings.catch_warnings(), _quiet_dcp_fallback():
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp_load(local_sd, storage_reader=reader, no_dist=True)
            except CheckpointException as exc:
                error = reader.failure or _unwrap(exc)
            if localmode.confirm(error is None, self._commit_group):
                self.last_load = {"step": chosen, "seconds": time.perf_counter() - t0,
                                  "tiers": sorted(set(reader.tiers_used.values())),
                                  "skipped": [(s, "failed to load on some rank") for s in sorted(excluded)]}
                localmode.write_back(state_dict, local_sd)
                return chosen
            if step is not None or isinstance(error, (StateDictMismatchError,)):
                raise error if error is not None else IntegrityError(f"step {chosen} failed to load on another rank", step=chosen)
            self.log.warning(chosen, "failed to load on some rank (%s); trying an older step", error)
            excluded.add(chosen)

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


def _unwrap(exc: CheckpointException) -> BaseException:
    """The first tierckpt error inside DCP's per-rank wrapper, else the wrapper itself."""
    for _, failure in sorted(exc.failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, TierckptError):
            return inner
    return exc


@contextlib.contextmanager
def _quiet_dcp_fallback() -> Iterator[None]:
    """DCP logs a traceback when read_metadata raises; tierckpt reports that error itself."""
    dcp_logger = logging.getLogger()  # DCP's state_dict_loader logs on the root logger

    def drop(record: logging.LogRecord) -> bool:
        return "metadata is not found" not in record.getMessage()

    dcp_logger.addFilter(drop)
    try:
        yield
    finally:
        dcp_logger.removeFilter(drop)


def _chain(src: Future[None], dst: Future[None]) -> None:
    err = src.exception()
    if err is None:
        dst.set_result(None)
    else:
        dst.set_exception(err)

