"""The save path of ``Checkpointer``: stage into a slot, commit in memory, queue the drain.

Call order (every rank, same order): ``SavePath.save`` waits for the previous save's memory
commit (one save in flight per rank), copies the state into a shared-memory slot (or, with
``overlap``, starts the copy and returns), then hands the snapshot to the committer thread,
which waits for the copy (``SaveHandle.wait_staged`` returns then), plans (cached for this
SavePath only, dropped after a failed save: ``dcp.plancache``), checksums and commits the step
in memory, makes it visible on other nodes, and queues the durable copy. ``fence`` orders the caller after the pending copy (an optimizer's step
pre-hook calls it). After a save, a reservation thread allocates and faults in the slots
the next saves will need (``memory_steps_retained + 1`` in all, within the budget), so only
the first save of a state size pays for allocation. ``wait`` waits for every handle;
``close`` stops the threads after ``wait``.
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tierckpt import guard, localmode, metrics, monitor
from tierckpt.dcp import fallback
from tierckpt.dcp.plancache import CachedSavePlanner
from tierckpt.dcp.writer import DurableWriter, TieredStorageWriter
from tierckpt.drain import DrainQueue
from tierckpt.errors import NonFiniteLossError
from tierckpt.handles import SaveHandle, settle
from tierckpt.observability import StepLogger, throughput
from tierckpt.runtime import RankRuntime
from tierckpt.snapshot import Snapshot, resolve_stateful
from tierckpt.topology import NodeTopology

__all__ = ["SavePath"]


class SavePath:
    """Saves of one ``Checkpointer``: the committer thread, the in-flight save, the handles."""

    def __init__(self, runtime: RankRuntime, topology: NodeTopology, drains: DrainQueue | None,
                 log: StepLogger, *, local: bool) -> None:
        self.runtime = runtime
        self.topo = topology
        self.drains = drains
        self.log = log
        self.local = local  # the runtime's per-rank config of local mode is not itself in local mode
        #: plans are cached per Checkpointer: a new one (a new generation, a replaced rank) plans afresh on every rank
        self._planner = CachedSavePlanner()
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="tierckpt-commit")
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="tierckpt-copy")  # overlapped CPU copies
        self._reserver = ThreadPoolExecutor(1, thread_name_prefix="tierckpt-reserve")
        self._reserved_for = 0  # slot size the reservation thread last prepared
        self._reservation: Future[int] | None = None
        self._pending: Snapshot | None = None  # the overlapped snapshot whose copy may still run
        self._inflight: Future[None] | None = None
        self._handles: list[SaveHandle] = []
        self._saves = 0  # saves committed here: the same count on every rank
        self._heap = fallback.heap_stager()  # where a save stages when shared memory fails
        self._fell_back = False  # warned about a fallback already (then info)

    def save(self, step: int, state_dict: dict[str, Any], go_durable: bool, *, overlap: bool = False,
             check_snapshot: bool = False) -> SaveHandle:
        """Copy ``state_dict`` into a slot (or start to, with ``overlap``), then commit in the background."""
        self.wait_inflight(step)
        t0 = time.perf_counter()
        cause: str | None = None
        try:  # objects that cannot be saved are reported here, naming the key, before any copy
            sd = guard.saveable(localmode.localize(state_dict) if self.local else resolve_stateful(state_dict), step)
        except Exception as exc:
            raise (err := guard.typed(exc, step=step)) from err.__cause__
        try:
            snap = self.runtime.stager.stage(sd, copier=self._copier if overlap else None,
                                             checksums=overlap and check_snapshot, step=step)
        except Exception as exc:
            err = guard.typed(exc, step=step)
            cause = fallback.memory_failure(err) if self.runtime.config.durable_url is not None else None
            if cause is None:
                raise err from err.__cause__
            self._fallback_warning(step, cause, err)
            snap = self._heap.stage(sd, step=step)  # this process's memory: the durable tier reads it
            overlap = False
        handle = SaveHandle(step, go_durable, 0.0)
        handle.fallback = cause
        watch = monitor.watch_save(step)  # a non-finite loss before the commit holds it back
        if overlap:
            self._pending = snap
            if snap._copy is not None:  # CPU: staged as soon as the copy thread is done
                snap._copy.add_done_callback(lambda f: _chain(f, handle._staged))
        else:
            try:
                self._staged(snap, handle)
            except BaseException:
                self.runtime.stager.release(snap)
                raise
        handle.blocking_s = blocking = time.perf_counter() - t0
        monitor.beat()  # a long save is progress, not a hang (tierckpt run)
        metrics.save_staged(self.runtime, handle, snap.nbytes)
        self.log.info(step, "%s %d bytes in shared memory in %s; committing in the background",
                      "started copying" if overlap else "staged", snap.nbytes, throughput(snap.nbytes, blocking))
        self._inflight = self._committer.submit(self._commit, step, snap, go_durable, handle, watch)
        self._handles = [h for h in self._handles if not h.done()] + [handle]
        if cause is None and snap.nbytes != self._reserved_for:  # a first save or a new size: start now; else after the commit
            self.reserve(snap.nbytes)
        return handle

    @property
    def saves_made(self) -> int:
        """Saves this path has run the commit of (committed or not): the same count on every rank."""
        return self._saves

    def fence(self) -> None:
        """Order what the caller does next after the pending overlapped copy; never raises."""
        snap = self._pending
        if snap is not None:
            snap.fence()

    def reserve(self, nbytes: int) -> Future[int]:
        """Prepare the slots for saves of ``nbytes`` in the background; the future gives the count prepared."""
        count = self.runtime.config.memory_steps_retained + 1
        self._reserved_for = nbytes
        self._reservation = self._reserver.submit(self.runtime.pool.reserve, nbytes, count)
        return self._reservation

    def _reserve_next(self, nbytes: int) -> None:
        """Top the slots up for the next saves, unless a reservation is still running.

        Called on the committer thread after each commit: retention may just have freed a
        slot of an older size, which is then resized ahead of need. (A save of a new size
        starts a reservation itself.)
        """
        running = self._reservation
        if running is None or running.done() or nbytes != self._reserved_for:
            self.reserve(nbytes)

    def _staged(self, snap: Snapshot, handle: SaveHandle) -> None:
        snap.wait_copied()
        settle(handle._staged)

    def wait_inflight(self, step: int | None) -> None:
        """Wait for the previous save's memory commit; its failure belongs to its handle."""
        inflight = self._inflight
        if inflight is not None and not inflight.done():
            self.log.info(step, "waiting for the previous save to commit (one save in flight per rank)")
        if inflight is not None:
            inflight.exception()

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

    def settle(self) -> None:
        """Wait for every save and durable copy so far without raising (before a load)."""
        self.wait_inflight(None)
        for h in self._handles:
            h._future.exception()

    def close(self) -> None:
        self._committer.shutdown(wait=True)
        self._copier.shutdown(wait=True)
        self._reserver.shutdown(wait=True)
        self._pending = None
        self._planner.forget()

    def _write_memory(self, writer: TieredStorageWriter, snap: Snapshot) -> None:
        writer._commit_nodes = False  # commit_other_nodes broadcasts on the commit group instead
        self._saves += 1
        writer._save_seq = self._saves
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                if self.local:  # this rank's shards alone, as one single-process checkpoint
                    dcp_save(snap.state_dict, storage_writer=writer, planner=self._planner, no_dist=True)
                else:
                    dcp_save(snap.state_dict, storage_writer=writer, planner=self._planner,
                             process_group=self.topo.commit_group)
        except CheckpointException as exc:
            # DCP reports a failure on every rank: each drops its cached plans, so the next save
            # plans afresh everywhere (a coordinator that cached before the failure would otherwise
            # send ranks without an entry an "unchanged" plan)
            self._planner.forget()
            raise (err := guard.typed(exc, step=writer.step)) from err.__cause__

    def _commit(self, step: int, snap: Snapshot, go_durable: bool, handle: SaveHandle,
                watch: monitor.SaveWatch) -> None:
        try:
            self._commit_watched(step, snap, go_durable, handle, watch)
        finally:
            watch.close()

    def _commit_watched(self, step: int, snap: Snapshot, go_durable: bool, handle: SaveHandle,
                        watch: monitor.SaveWatch) -> None:
        writer = TieredStorageWriter(self.runtime.config, step=step, durable=False, _runtime=self.runtime)
        writer._snapshot = snap  # write_data takes it (and the slot); left set, the slot is still ours
        writer._gate = watch.reason  # checked on every rank before the commit: any rank's veto holds for all
        in_dcp = False  # a failure inside DCP's save reaches every rank: all of them can fall back
        try:
            self._staged(snap, handle)  # an overlapped copy lands (or fails) here
            if self._can_fall_back and fallback.agree(handle.fallback is not None,
                                                      None if self.local else self.topo.commit_group):
                handle.fallback = handle.fallback or "other_rank"
                self._save_durable_only(step, snap, handle, watch)
                return
            in_dcp = True
            self._write_memory(writer, snap)
            in_dcp = False
            save_id = writer._plan_data.save_id if writer._plan_data is not None else None
            small = self.topo.commit_other_nodes(self.runtime, step, save_id, writer.committed)
        except BaseException as raw:
            failure = guard.typed(raw, step=step)
            if isinstance(failure, NonFiniteLossError):
                if writer._snapshot is not None:  # failed before write_data took the slot
                    fallback.release(self.runtime, snap)
                self.log.warning(step, "save skipped, nothing committed: %s", failure.message)
                handle._skip(failure.message)
                return
            cause = fallback.memory_failure(failure) if in_dcp and self._can_fall_back else None
            if cause is not None:  # the copy is intact: the slot is reused by the next save only
                self._fallback_warning(step, cause, failure)
                handle.fallback = cause
                self._save_durable_only(step, snap, handle, watch)
                return
            if writer._snapshot is not None:  # failed before write_data took the slot
                fallback.release(self.runtime, snap)
            self.log.warning(step, "save failed: %s", failure)
            metrics.save_failed(self.runtime, handle)
            handle._fail(failure)
            return
        metrics.memory_committed(self.runtime, handle)
        handle._memory.set_result(None)
        self._reserve_next(snap.nbytes)
        if not go_durable or self.drains is None or save_id is None:
            handle._future.set_result(None)
            return
        future = self.drains.submit(step, save_id, list(writer.files_written), small)
        future.add_done_callback(lambda f: _chain(f, handle._future))


    # -- the durable fallback (dcp/fallback.py) -----------------------------------------
    @property
    def _can_fall_back(self) -> bool:
        return self.runtime.config.durable_url is not None

    def _fallback_warning(self, step: int, cause: str, err: BaseException) -> None:
        """Warn at the first fallback of this Checkpointer (later ones log at info); count each."""
        metrics.memory_fallback(self.runtime, cause)
        say = self.log.info if self._fell_back else self.log.warning
        self._fell_back = True
        say(step, "the memory tier failed (%s: %s); this save goes straight to the durable tier (%s)",
            cause, err, self.runtime.config.durable_url)

    def _save_durable_only(self, step: int, snap: Snapshot, handle: SaveHandle, watch: monitor.SaveWatch) -> None:
        """Every rank writes ``step`` from its copy to the durable tier in one DCP save; settle ``handle``."""
        t0 = time.perf_counter()
        writer = DurableWriter(self.runtime.config, step=step, durable=True, _runtime=self.runtime)
        writer._snapshot, writer._gate, writer._commit_nodes = snap, watch.reason, False
        self._saves += 1
        writer._save_seq = self._saves
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp_save(snap.state_dict, storage_writer=writer, planner=DefaultSavePlanner(),
                         process_group=None if self.local else self.topo.commit_group, no_dist=self.local)
        except BaseException as raw:
            if writer._snapshot is not None:
                fallback.release(self.runtime, snap)
            failure = guard.typed(raw, step=step)
            if isinstance(failure, NonFiniteLossError):
                handle._skip(failure.message)
                return
            self.log.warning(step, "save failed: the memory tier failed and so did the durable fallback: %s", failure)
            metrics.save_failed(self.runtime, handle)
            handle._fail(failure)
            return
        metrics.durable_committed(self.runtime, step, snap.nbytes, time.perf_counter() - t0)
        handle._memory.set_result(None)
        handle._future.set_result(None)


def _chain(src: Future[None], dst: Future[None]) -> None:
    settle(dst, src.exception())
