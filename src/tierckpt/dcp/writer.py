"""``TieredStorageWriter``: a PyTorch DCP StorageWriter over the memory and durable tiers.

Call order (driven by ``dcp.save`` / ``dcp.async_save``):
  every rank    reset(checkpoint_id)?  → storage_meta() → set_up_storage_writer(...)
                → prepare_local_plan(plan)
  coordinator   prepare_global_plan(plans)   picks the save id and each rank's file name
  every rank    write_data(plan, planner)    copies into a shared-memory slot (raw bytes),
                                             checksums each item, links the slot into the
                                             memory tier's staging area and, when durable,
                                             copies the file to the durable tier
  coordinator   finish(metadata, results)    writes .metadata + manifest, then the marker:
                                             memory first, then durable; then retention
A durable failure never undoes the memory commit: finish commits memory, then raises
DurableWriteError (DCP reports it wrapped in CheckpointException).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tierckpt import guard, layout, metrics
from tierckpt._torch_compat import StorageInfo as _StorageInfo
from tierckpt.config import CheckpointConfig
from tierckpt.dcp import fallback, node_commit
from tierckpt.dcp.plan import ItemInfo, PlanData, checksums_of, durable_tier, spans_of
from tierckpt.errors import (
    ConfigError,
    DurableWriteError,
    NonFiniteLossError,
    ProtocolError,
    StorageError,
)
from tierckpt.observability import StepLogger, throughput
from tierckpt.policy import DurablePolicy
from tierckpt.record import dumps_metadata
from tierckpt.runtime import RankRuntime, runtime_for
from tierckpt.snapshot import Snapshot
from tierckpt.tiers import Source

__all__ = ["DurableWriter", "TieredStorageWriter"]

@dataclass(frozen=True)
class _NodeId:
    """Set on each local plan: which memory tier (node) the rank writes into."""

    host: str
    memory_root: str


class TieredStorageWriter(StorageWriter):
    """Save a DCP checkpoint into tierckpt's tiers.

    ``step`` wins; else the step is the last ``step_<N>`` component of ``path`` or of the
    ``checkpoint_id`` given to ``dcp.save``. ``durable``: True/False force the durable copy,
    None follows ``config.durable_every_n_steps``.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        path: str | None = None,
        step: int | None = None,
        durable: bool | None = None,
        *,
        _runtime: RankRuntime | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, CheckpointConfig):
            raise ConfigError("config must be a tierckpt.CheckpointConfig")
        self.config = config
        self.path = path
        self._step = layout.validate_step(step) if step is not None else None
        if self._step is None and path is not None:
            self._step = layout.step_from_path(path)
        self.durable_requested = durable
        self._runtime = _runtime
        self._commit_nodes = True  # Checkpointer commits other nodes itself and turns this off
        #: the caller's save count, identical on every rank: with a cached plan (whose save id
        #: was drawn once) it keeps each save's id unique without another collective
        self._save_seq: int | None = None
        self.rank = _global_rank()
        self.is_coordinator = True
        self.save_id: str | None = None
        self.committed: tuple[bytes, bytes] | None = None  # (.metadata, manifest) after finish
        self._plan_data: PlanData | None = None
        self._snapshot: Snapshot | None = None
        self.files_written: list[str] = []
        self._durable_exc: StorageError | None = None
        self._synchronize_after_execute = False  # stage() returns only once the copy landed
        self._t_write: float | None = None  # when write_data began, for the commit-seconds metric
        #: a Checkpointer passes its runtime and reports its own saves (tierckpt_saves_total ...):
        #: only a writer used on its own (dcp.save, the integrations, the compat API) reports here
        self.reports_metrics = _runtime is None
        metrics.enable_from_env()  # TIERCKPT_METRICS_PORT: as Checkpointer, so DCP-plug-in users report too
        #: Checkpointer's hold on the commit: a reason not to commit (a non-finite loss), or None
        self._gate: Callable[[], str | None] | None = None
        self._memory_failure: BaseException | None = None  # stage() fell back to process memory

    # -- identity -------------------------------------------------------------------
    @property
    def step(self) -> int:
        if self._step is None:
            raise ConfigError(
                "no step for this save: pass step=N or a path ending in 'step_N' to "
                "TieredStorageWriter, or checkpoint_id='.../step_N' to dcp.save"
            )
        return self._step

    @property
    def checkpoint_id(self) -> str:
        """Where this step goes in the memory tier; raises ConfigError when there is no step.

        ``dcp.save`` reads this attribute before its first collective, so a save without a
        step fails here, on the caller's thread, with tierckpt's own error (inside the
        collectives DCP would wrap it in its ``CheckpointException``).
        """
        return f"{self.config.memory_dir}/{self.config.namespace}/{layout.step_dir_name(self.step)}"

    @property
    def durable(self) -> bool:
        policy = DurablePolicy(self.config.durable_every_n_steps, self.config.durable_url is not None)
        if self.durable_requested and self.config.durable_url is None:
            raise ConfigError("durable=True but the config has no durable_url")
        return policy.should_save(self.step, self.durable_requested)

    @property
    def runtime(self) -> RankRuntime:
        if self._runtime is None:
            self._runtime = runtime_for(self.config, self.rank)
        return self._runtime

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return layout.step_from_path(checkpoint_id) is not None

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None and self._step is None:
            self._step = layout.step_from_path(checkpoint_id)
            if self._step is None:
                raise ConfigError(
                    f"checkpoint_id {str(checkpoint_id)!r} names no step; end it with 'step_N'"
                )
        self.save_id = None
        self.committed = None

    def storage_meta(self) -> StorageMeta | None:
        # called before set_up_storage_writer: must not bind the runtime
        where = f"{self.config.memory_dir}/{self.config.namespace}"
        return StorageMeta(checkpoint_id=f"{where}/{layout.step_dir_name(self._step)}" if self._step is not None else where)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        # slots are per global rank: DCP's ``rank`` is relative to the save's process group
        self.rank = _global_rank()
        _ = self.step  # fail before any collective if there is no step

    # -- AsyncStager (dcp.async_save blocks only for this copy) ------------------------
    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    #: whether ``stage`` may run before the step is known: ``dcp.async_save`` stages before it hands
    #: ``checkpoint_id`` to ``reset``; a subclass that takes the step from it (the SageMaker API) sets this
    stage_before_step = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into a shared-memory slot; return the state dict DCP will save."""
        # dcp.async_save stages first: fail before the copy if there is no step (unless it comes later)
        step = self._step if self.stage_before_step else self.step
        try:
            snap = self.runtime.stager.stage(guard.saveable(state_dict, step))
        except Exception as exc:
            snap = fallback.stage_instead(self, guard.typed(exc, step=step), state_dict)
        snap.wait_copied()
        self._snapshot = snap
        return snap.state_dict

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns after the copy."""

    def close(self) -> None:
        """Slots belong to the rank's runtime, not to the writer."""

    # -- planning -------------------------------------------------------------------
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        node = _NodeId(socket.gethostname(), os.path.realpath(self.config.memory_dir))
        return dataclasses.replace(plan, storage_data=node)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        save_id = uuid.uuid4().hex[:12]
        nodes = [p.storage_data if isinstance(p.storage_data, _NodeId) else None for p in plans]
        leaders: dict[_NodeId, int] = {}
        for i, node in enumerate(nodes):
            if node is not None and node != nodes[0]:
                leaders.setdefault(node, i)
        remote = len(leaders) if self._commit_nodes else 0
        out = []
        for i, (plan, node) in enumerate(zip(plans, nodes, strict=True)):
            leads = remote > 0 and node is not None and leaders.get(node) == i
            pd = PlanData(layout.data_file_name(i), save_id, len(plans), commit_node=leads,
                           remote_nodes=remote if i == 0 else 0)
            out.append(dataclasses.replace(plan, storage_data=pd))
        return out

    # -- writing --------------------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fut: Future[list[WriteResult]] = Future()
        self._t_write = time.perf_counter()
        try:
            fut.set_result(self._write(plan, planner))
        except BaseException as exc:  # DCP collects the failure from the future
            self._metric(metrics.dcp_failed, "memory")
            fut.set_exception(cast(Any, guard.typed(exc, step=self._step, tier="memory")))
        return fut

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        pd = plan.storage_data
        if not isinstance(pd, PlanData):
            raise ProtocolError("write_data called before prepare_global_plan assigned a file")
        if self._save_seq is not None:
            pd = dataclasses.replace(pd, save_id=f"{pd.save_id}-{self._save_seq:x}")
        self._plan_data, self.save_id = pd, pd.save_id
        rt, step, log = self.runtime, self.step, StepLogger("writer", self.rank, self.config.logger)
        node_commit.raise_background_error(rt, step)
        self._check_gate()
        log.info(step, "Starting checkpoint write (%d items)", len(plan.items))
        with rt.save_lock:
            rt.in_flight.add(pd.save_id)
            try:
                try:
                    if self._memory_failure is not None:
                        raise self._memory_failure
                    results = self._write_locked(plan, planner, pd, rt, step, log)
                except Exception as exc:  # the memory tier failed: the durable tier, when this save writes it
                    results = fallback.write_instead(self, exc, plan, planner, pd, log)
                self._check_gate(abort=pd.save_id)  # every rank's last word before the coordinator commits
                from tierckpt import monitor  # every save path writes here: a save is progress (tierckpt run)

                monitor.saved()
                return results
            finally:
                rt.in_flight.discard(pd.save_id)

    def _check_gate(self, abort: str | None = None) -> None:
        """Raise NonFiniteLossError when the save's gate (a non-finite loss) holds it back."""
        reason = self._gate() if self._gate is not None else None
        if reason is None:
            return
        if abort is not None:
            self.runtime.memory.abort(self.step, abort)  # this rank's staged files (never raises)
        raise NonFiniteLossError(f"step {self.step} was not committed: {reason}", step=self.step)

    def _write_locked(self, plan: SavePlan, planner: SavePlanner, pd: PlanData, rt: RankRuntime,
                      step: int, log: StepLogger) -> list[WriteResult]:
        t0 = time.perf_counter()
        snap, self._snapshot = self._snapshot, None
        if snap is None:  # synchronous save: copy into a fresh slot now
            snap = rt.stager.stage_items(plan.items, planner)
            log.info(step, "In-memory staging completed in %s", throughput(snap.nbytes, time.perf_counter() - t0))
        else:
            snap.wait_copied()
        extra_name = pd.file_name.replace("_0.distcp", "_1.distcp")
        try:
            spans, extras = spans_of(plan.items, planner, snap, pd.file_name, extra_name)
            digests = checksums_of(rt, spans, {pd.file_name: snap.slot, extra_name: extras})
            sizes = {pd.file_name: snap.nbytes, extra_name: len(extras)}
            files: dict[str, Source] = {pd.file_name: snap.slot.path}
            if extras:
                files[extra_name] = bytes(extras)
            with log.timed(step, "In-memory write", snap.nbytes + len(extras)):
                for name, source in files.items():
                    rt.memory.put_file(step, pd.save_id, name, source)
            self._metric(metrics.dcp_written, "memory", snap.nbytes + len(extras))
            durable_error = None
            if self.durable:
                durable = durable_tier(rt, step)
                try:
                    with log.timed(step, f"Durable write ({durable.location(step)})", snap.nbytes + len(extras)):
                        for name, source in files.items():
                            durable.put_file(step, pd.save_id, name, source)
                    self._metric(metrics.dcp_written, "durable", snap.nbytes + len(extras))
                except StorageError as exc:
                    durable_error = f"rank {self.rank}: {exc}"
                    self._durable_exc = exc  # the coordinator chains its own failure in finish
                    log.warning(step, "durable write failed: %s", exc)
        finally:
            rt.stager.release(snap)
        self.files_written = sorted(files)
        if pd.commit_node:
            node_commit.await_publication(rt, step, pd.save_id, log)
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=length,
                storage_data=ItemInfo(_StorageInfo(name, offset, length), data_offset, digest, sizes[name], durable_error),
            )
            for (item, name, offset, length, data_offset), digest in zip(spans, digests, strict=True)
        ]

    # -- commit ---------------------------------------------------------------------
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        rt, step, log = self.runtime, self.step, StepLogger("writer", self.rank, self.config.logger)
        infos: dict[MetadataIndex, ItemInfo] = {
            wr.index: wr.storage_data for rank_results in results for wr in rank_results
        }
        save_id = self.save_id or (self._plan_data.save_id if self._plan_data else None)
        if save_id is None:
            raise ProtocolError("finish called before write_data")
        metadata.storage_data = {idx: info.storage for idx, info in infos.items()}
        md_raw = dumps_metadata(metadata)
        files = {info.storage.relative_path: info.file_size for info in infos.values()}
        manifest = layout.Manifest(
            namespace=self.config.namespace, step=step, save_id=save_id,
            world_size=len(results), metadata_xxh3=layout.checksum(md_raw), files=files,
            items=tuple(
                layout.ItemRecord(i.storage.relative_path, i.storage.offset, i.storage.length, i.data_offset, i.xxh3)
                for i in sorted(infos.values(), key=lambda i: (i.storage.relative_path, i.storage.offset))
            ),
        )
        mf_raw = manifest.to_bytes()
        small = {layout.METADATA: md_raw, layout.MANIFEST: mf_raw}
        self._check_gate(abort=save_id)
        if fallback.commit_instead(self, infos.values(), save_id, small):
            return  # the memory tier failed on some rank: committed to the durable tier only
        rt.committed_in_memory(step)
        self.committed = (md_raw, mf_raw)
        if self._plan_data is not None and self._plan_data.remote_nodes:
            node_commit.publish(rt, step, save_id, md_raw, mf_raw, log)
        log.info(step, "Committed to memory (%s), metadata %d bytes", rt.memory.location(step), len(md_raw))
        self._metric(metrics.dcp_committed, "memory", step, self._since_write())
        rt.apply_retention(rt.memory, rt.memory_retention)
        if self.durable:
            durable = durable_tier(rt, step)
            failed = sorted({i.durable_error for i in infos.values() if i.durable_error})
            if failed:
                self._metric(metrics.dcp_failed, "durable")
                raise DurableWriteError(
                    f"durable copy of step {step} failed on some rank (memory copy is committed): "
                    + "; ".join(failed),
                    tier="durable", step=step,
                ) from self._durable_exc  # other ranks' errors arrive as text (DCP gathers results)
            try:
                durable.commit(step, save_id, small)
            except StorageError as exc:
                self._metric(metrics.dcp_failed, "durable")
                raise DurableWriteError(
                    f"durable commit of step {step} failed (memory copy is committed): {exc}",
                    tier="durable", step=step,
                ) from exc
            log.info(step, "Committed to durable (%s)", durable.location(step))
            self._metric(metrics.dcp_committed, "durable", step, self._since_write())
            rt.apply_retention(durable, rt.durable_retention)

    def _metric(self, hook: Any, tier: str, *args: Any) -> None:
        if self.reports_metrics:
            hook(self.config.namespace, tier, *args)

    def _since_write(self) -> float:
        return 0.0 if self._t_write is None else time.perf_counter() - self._t_write


class DurableWriter(TieredStorageWriter):
    """Writes one step to the durable tier only: the same files, checksums and manifest, marker last.

    The caller (``SavePath``) sets ``_snapshot`` (a slot or heap copy); DCP then drives it as
    any writer (``write_data`` on every rank, ``finish`` on the coordinator, which
    ``commit_instead`` turns into a durable-only commit).
    """

    def _write_locked(self, plan: SavePlan, planner: SavePlanner, pd: PlanData, rt: RankRuntime,
                      step: int, log: StepLogger) -> list[WriteResult]:
        snap, self._snapshot = self._snapshot, None
        if snap is None:
            raise ProtocolError("the durable fallback needs the step's copy (DurableWriter._snapshot)")
        return fallback.write_durable(self, snap, plan, planner, pd, log, "memory tier bypassed")


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
