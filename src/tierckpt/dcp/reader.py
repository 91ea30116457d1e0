"""``TieredStorageReader``: a PyTorch DCP StorageReader that reads the best verified copy.

Call order (driven by ``dcp.load``, every rank):
  reset(checkpoint_id)? → read_metadata()          lists this rank's tiers, agrees on one step
                                                    with every rank (one all_gather per round),
                                                    returns that step's verified DCP Metadata
                                                    (``sources.py``, ``agree.py``)
  → set_up_storage_reader(metadata, is_coordinator) → prepare_local_plan → [coordinator]
  prepare_global_plan → read_data(plan, planner)    dtype casts and unloaded keys warned about
                                                    (or, strict, refused: ``matching.py``); per
                                                    file the memory tier first, then peers, then
                                                    durable; each record checked as it lands in
                                                    its tensor (``items.py``); a bad copy falls
                                                    back to the next tier; none good →
                                                    IntegrityError; objects only through the
                                                    allow-list (``safeload.py``)
After ``dcp.load`` returns, ``step`` and ``tiers_used`` tell what was loaded from where.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tierckpt import layout, metrics
from tierckpt.config import CheckpointConfig
from tierckpt.dcp.agree import Availability, choose_step, gather
from tierckpt.dcp.items import ItemReader
from tierckpt.dcp.matching import check_expected, check_plan
from tierckpt.dcp.sources import StepSources
from tierckpt.errors import CheckpointNotFoundError, ConfigError, ProtocolError, TierckptError
from tierckpt.observability import StepLogger, throughput
from tierckpt.runtime import RankRuntime, runtime_for

__all__ = ["TieredStorageReader"]


class TieredStorageReader(StorageReader):
    """Load a checkpoint saved by tierckpt (or any DCP checkpoint in tierckpt's layout).

    ``step=None`` loads the newest step every rank can load completely (older steps are
    used, with a warning, when newer ones are damaged), older than ``config.resume_before``
    when that is set; steps that exist but that no rank set can load → NoUsableStepError; an
    explicit step loads that step or raises CheckpointNotFoundError / IntegrityError. ``path`` may name the step as
    ``.../step_N``. ``process_group`` must be the group given to ``dcp.load``.

    ``verify_ahead`` (default True) checks this rank's share of the data before anyone reads,
    so that ``dcp.load`` itself moves to an older step when the newest is damaged beyond every
    copy; it costs a pass over the data. With False the data is checked only while it is read
    (one pass: the load runs at memory speed), and a step damaged beyond every copy is an
    IntegrityError that ``Checkpointer.load`` answers by loading an older step.
    ``strict=True`` refuses dtype casts and checkpoint keys the state dict does not load
    (StateDictMismatchError); by default both are warnings; ``partial=True`` says the caller
    loads a subset of the keys on purpose (no warning for the rest). Non-tensor objects are loaded only
    from an allow-list unless ``trusted`` (default: the config's); ``allowed_classes`` adds to it.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        step: int | None = None,
        path: str | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        exclude_steps: Iterable[int] = (),
        expect: dict[str, Any] | None = None,
        single_process: bool = False,
        verify_ahead: bool = True,
        strict: bool = False,
        partial: bool = False,
        trusted: bool | None = None,
        allowed_classes: Iterable[Any] = (),
        _runtime: RankRuntime | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, CheckpointConfig):
            raise ConfigError("config must be a tierckpt.CheckpointConfig")
        self.config = config
        self.requested = layout.validate_step(step) if step is not None else None
        if self.requested is None and path is not None:
            self.requested = layout.step_from_path(path)
        self.group = process_group
        self.exclude = frozenset(exclude_steps)
        self.expect = expect
        #: with ``single_process`` (dcp.load(..., no_dist=True)) this reader neither gathers nor
        #: takes the process's rank: it reads one rank's own checkpoint as rank 0
        self.single_process = single_process
        self.verify_ahead = verify_ahead
        self.strict = strict
        self.partial = partial  # the caller loads a subset of the keys on purpose: no unloaded-key warning
        self.trusted = config.trusted if trusted is None else trusted
        self.allowed_classes = (*config.allowed_classes, *allowed_classes)
        distributed = dist.is_available() and dist.is_initialized() and not single_process
        self.rank = dist.get_rank(process_group) if distributed else 0
        self._runtime = _runtime
        self.step: int | None = None
        self.skipped: tuple[tuple[int, str], ...] = ()
        self.tiers_used: dict[str, str] = {}  # file → tier name it was read from
        self._sources: StepSources | None = None
        self._metadata: Metadata | None = None
        self._manifest: layout.Manifest | None = None
        self._log = StepLogger("reader", self.rank, config.logger)
        #: the tierckpt error this reader raised, if any (DCP re-wraps read_metadata errors)
        self.failure: TierckptError | None = None
        #: whether a completed read_data reports the load (tierckpt_loads_total ...); a caller
        #: that loads one step in several reads turns it off for all but one
        self.reports_metrics = _runtime is None  # a Checkpointer passes its runtime and reports its own loads
        self._t_load: float | None = None
        metrics.enable_from_env()  # TIERCKPT_METRICS_PORT: as Checkpointer, so DCP-plug-in users report too

    @property
    def runtime(self) -> RankRuntime:
        if self._runtime is None:
            self._runtime = runtime_for(self.config, self.rank)
        return self._runtime

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return layout.step_from_path(checkpoint_id) is not None

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None and self.requested is None:
            self.requested = layout.step_from_path(checkpoint_id)

    # -- choosing the step ----------------------------------------------------------
    def read_metadata(self) -> Metadata:  # no **kwargs: tierckpt keeps global metadata only
        self._t_load = time.perf_counter()
        try:
            return self._read_metadata()
        except TierckptError as exc:
            self.failure = exc
            raise

    def _read_metadata(self) -> Metadata:
        sources = self._sources = StepSources(
            self.config, self.runtime, self.rank, self._log, requested=self.requested, exclude=self.exclude
        )
        local = sources.local_availability()
        everyone = self._gather(local)
        while True:  # every rank runs the same rounds: the choice and the verdicts are shared
            choice = choose_step(everyone, self.requested, namespace=self.config.namespace)
            if choice is None:
                raise CheckpointNotFoundError(
                    f"namespace {self.config.namespace!r} has no checkpoint in any tier"
                )
            sources.use(choice.step, local)
            verdicts = self._gather(sources.precheck(choice.step, self._world_size(), verify_data=self.verify_ahead))
            failed = "; ".join(v for v in verdicts if v)
            if not failed:
                break
            everyone = [_demote(a, choice.step, failed) for a in everyone]
            local = _demote(local, choice.step, failed)
        self.step, self.skipped = choice.step, choice.skipped
        for step, reason in self.skipped:
            self._log.warning(step, "skipped: %s; loading step %d instead", reason, choice.step)
        self._metadata, self._manifest = sources.metadata(choice.step)
        if self.expect is not None:
            check_expected(self.expect, self._metadata, choice.step)
        return self._metadata

    def _gather(self, value: Any) -> list[Any]:
        return [value] if self.single_process else gather(value, self.group)

    def _world_size(self) -> int:
        if self.single_process or not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    # -- planning -------------------------------------------------------------------
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    # -- reading --------------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            self._read_data(plan, planner)
        except TierckptError as exc:
            self.failure = exc
            raise
        self.report_load()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def report_load(self) -> None:
        """Count this rank's completed load in the library metrics (unless ``reports_metrics`` is off)."""
        if self.reports_metrics:
            seconds = 0.0 if self._t_load is None else time.perf_counter() - self._t_load
            metrics.dcp_loaded(self.config.namespace, self.step, seconds, self.tiers_used.values())

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        step, manifest, metadata, sources = self.step, self._manifest, self._metadata, self._sources
        if step is None or manifest is None or metadata is None or sources is None:
            raise ProtocolError(
                "read_data was called before read_metadata chose a step; call dcp.load (or "
                "read_metadata, then set_up_storage_reader) first"
            )
        check_plan(plan, planner, metadata, step, strict=self.strict, log=self._log, partial=self.partial)
        t0 = time.perf_counter()
        items = ItemReader(
            sources, step, manifest, metadata, executor=self.runtime.executor, threads=self.config.io_threads,
            log=self._log, trusted=self.trusted, allowed=self.allowed_classes,
        )
        try:
            nbytes = items.read(plan, planner)
        finally:
            self.tiers_used.update(items.tiers_used)
        self._log.info(step, "Read %d items from %s in %s", len(plan.items), sorted(set(self.tiers_used.values())),
                       throughput(nbytes, time.perf_counter() - t0))


def _demote(a: Availability, step: int, reason: str) -> Availability:
    """``a`` with ``step`` marked unloadable in every tier, for the next round of choosing."""
    return dataclasses.replace(
        a,
        memory={s: f for s, f in a.memory.items() if s != step},
        durable=None if a.durable is None else a.durable - {step},
        bad={**a.bad, step: reason},
    )
