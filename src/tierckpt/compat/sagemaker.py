"""SageMaker HyperPod tiered checkpointing's API, running on tierckpt.

Code written for ``amzn_sagemaker_checkpointing`` runs after changing its imports to this module:

    from tierckpt.compat.sagemaker import (
        SageMakerCheckpointConfig, SageMakerTieredStorageReader, SageMakerTieredStorageWriter,
    )
    config = SageMakerCheckpointConfig(namespace="job-1", world_size=dist.get_world_size(),
                                       s3_tier_base_path="s3://bucket/checkpoints")
    config.save_to_s3 = step % 50 == 0
    future = dcp.async_save(state_dict, storage_writer=SageMakerTieredStorageWriter(config, step=step))
    dcp.load(state_dict, storage_reader=SageMakerTieredStorageReader(config))   # newest step

Mapping: the memory tier is node-local shared memory (``memory_dir``) instead of the HyperPod
memory service. The S3 copy is, by default (``s3_layout="sagemaker"``), the SageMaker library's
own format in its strategy's layout, ``{base}/{namespace}/rank_{R}/step_{N}/`` (``sagemaker_write``),
so the library and existing tools read it back; ``s3_layout="tierckpt"`` makes it tierckpt's
durable tier at ``<base>/<namespace>/step_<N>/`` instead (plain DCP per step, the default before
issue 24). The reader loads both: an asked-for step from whichever layout holds it, else the
newest of either; ``tierckpt import`` converts the library's steps. ``save_to_s3`` is read once, when a writer is built,
so changing it for the next step cannot affect a save still in flight. The seed's validation messages are
kept; its errors derive from ``tierckpt.TierckptError`` as well.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, cast

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from tierckpt import metrics
from tierckpt.compat.legacy import CHECKPOINT_FILE, METADATA_FILE, LegacySource, SageMakerStorageInfo
from tierckpt.compat.sagemaker_config import (
    CheckpointConfig,
    SageMakerCheckpointConfig,
    SageMakerInMemoryTierError,
    SageMakerS3TierError,
    SageMakerTieredStorageConfigError,
    SageMakerTieredStorageError,
    one_config,
    our_strategy,
    parse_step,
    tierckpt_step_dir,
    to_tierckpt,
    validated,
)
from tierckpt.compat.sagemaker_paths import DefaultS3PathStrategy, RayS3PathStrategy, S3PathStrategy
from tierckpt.dcp import fallback
from tierckpt.dcp.reader import TieredStorageReader
from tierckpt.dcp.writer import TieredStorageWriter
from tierckpt.errors import (
    CheckpointNotFoundError,
    DurableWriteError,
    StorageError,
    TierckptError,
)
from tierckpt.observability import StepLogger

__all__ = [
    "CheckpointConfig",
    "DefaultS3PathStrategy",
    "RayS3PathStrategy",
    "S3PathStrategy",
    "SageMakerCheckpointConfig",
    "SageMakerInMemoryTierError",
    "SageMakerS3TierError",
    "SageMakerTieredStorageConfigError",
    "SageMakerTieredStorageError",
    "SageMakerTieredStorageReader",
    "SageMakerTieredStorageWriter",
    "parse_step",
    "tierckpt_step_dir",
    "to_tierckpt",
    "validated",
]

@dataclass
class _BothInfo:
    """A write result's storage data in the sagemaker layout: tierckpt's (memory) and the library's (S3)."""

    tierckpt: Any
    sagemaker: SageMakerStorageInfo | None


class SageMakerTieredStorageWriter(TieredStorageWriter):
    """``SageMakerTieredStorageWriter(checkpoint_config, path=None, step=-1)``: one step's save.

    The step: ``step`` when given, else ``step_<N>`` in ``path`` (a path without one raises the
    seed's "Invalid step value" here, as the seed does), else, when there is no path, the
    ``checkpoint_id`` given to ``dcp.save`` (the seed's docs' "basic writer"); a save with none of
    them fails with the same error. ``config=`` is accepted for ``checkpoint_config=``.
    Every save goes to the memory tier; it also goes to S3 when ``checkpoint_config.save_to_s3``
    is set at construction or its ``s3_every_n_steps`` divides the step, in the layout
    ``checkpoint_config.s3_layout`` names.

    Call order (DCP): ``reset(checkpoint_id)`` → ``set_up_storage_writer`` → plans →
    ``write_data`` on every rank (memory, then with ``s3_layout="sagemaker"`` this rank's
    ``checkpoint.pt``) → ``finish`` on the coordinator (memory commit, then the library's
    ``metadata.metadata``, the object that makes the step visible to it).
    """

    def __init__(
        self, checkpoint_config: SageMakerCheckpointConfig | None = None, path: Any = None, step: int = -1,
        *, config: SageMakerCheckpointConfig | None = None,
    ) -> None:
        checkpoint_config = one_config(checkpoint_config, config)
        # the seed checks the step before the config, and a path without one raises here as in the
        # seed; only with no path at all does the step wait for dcp.save's checkpoint_id
        resolved = None if step == -1 and path is None else parse_step(path, step)
        self.sagemaker_layout = checkpoint_config.s3_layout == "sagemaker"
        # read once, here: changing the config for the next step cannot affect this save
        self._s3_always, self._s3_every = bool(checkpoint_config.save_to_s3), checkpoint_config.s3_every_n_steps
        super().__init__(to_tierckpt(checkpoint_config), step=resolved)
        self.path = path  # as given (shown in the seed's "Invalid step value" message)
        self.stage_before_step = resolved is None  # async_save's checkpoint_id arrives after staging
        self.checkpoint_config = checkpoint_config
        self._sink: Any = None
        self.save_to_s3 = False
        self._decide_s3()

    def _decide_s3(self) -> None:
        """``save_to_s3`` for this writer's step (``s3_every_n_steps`` needs the step)."""
        step = self._step
        self.save_to_s3 = self._s3_always or (step is not None and self._s3_every > 0 and step % self._s3_every == 0)
        self.durable_requested = self.save_to_s3 and not self.sagemaker_layout

    @property
    def step(self) -> int:
        if self._step is None:
            raise SageMakerTieredStorageError(
                f"Invalid step value, step:-1. path:{'' if self.path is None else self.path}; pass step=N to the writer, a path with "
                "'step_N', or checkpoint_id='step_N' to dcp.save"
            )
        return self._step

    @staticmethod
    def _get_step_val(step: int, path: Any) -> int:
        """The seed's step rule under the seed's private name (its own tests call it): ``parse_step``."""
        return parse_step(path, step)

    @property
    def s3_checkpoint_dir(self) -> str | None:
        """The S3 directory with every rank's files of this step (e.g. for ``ray.train.report``).

        None without S3. As in the seed, ``DefaultS3PathStrategy`` raises (a NotImplementedError
        that is also a TierckptError); with any other strategy it is where the step goes,
        ``<base>/<namespace>/step_<N>``, known before the (async) write completes.
        """
        strategy = self.checkpoint_config.get_s3_strategy()
        if strategy is None:
            return None
        if isinstance(strategy, DefaultS3PathStrategy) or type(strategy).__name__ == "DefaultS3PathStrategy":
            DefaultS3PathStrategy(str(strategy.base_path)).get_checkpoint_dir(self.config.namespace, self.step)
        return tierckpt_step_dir(str(getattr(strategy, "base_path", strategy)), self.config.namespace, self.step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def reset(self, checkpoint_id: Any = None) -> None:
        """An explicit step (or a path with one) wins; else ``checkpoint_id`` names it (seed rule)."""
        if checkpoint_id is not None and self._step is None:
            self._step = parse_step(checkpoint_id, -1)
            self._decide_s3()
        super().reset(None)

    def _s3_sink(self) -> Any:
        if self._sink is None:
            from tierckpt.compat.sagemaker_write import SageMakerS3Sink

            strategy = our_strategy(self.checkpoint_config)
            if strategy is None:  # validated() refuses save_to_s3 without a path; kept for the type
                raise SageMakerTieredStorageConfigError("S3 save enabled but no S3 path configured.")
            self._sink = SageMakerS3Sink(strategy, self.config.namespace, self.config.s3)
        return self._sink

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fut = super().write_data(plan, planner)  # completed: the memory write is synchronous
        if not (self.sagemaker_layout and self.save_to_s3):
            return fut
        ours: list[WriteResult] | None
        try:
            ours = fut.value()
        except Exception as exc:
            cause = fallback.memory_failure(exc)
            if cause is None:  # not the memory tier: DCP reports it from the future as is
                return fut
            # the memory tier failed and the step goes to S3: S3 alone, as the seed does
            StepLogger("writer", self.rank, self.config.logger).warning(
                self._step, "the memory tier failed (%s: %s); this step is saved to S3 only", cause, exc)
            if self.save_id is not None:
                self.runtime.memory.abort(self.step, self.save_id)
            ours = None
        out: Future[list[WriteResult]] = Future()
        try:
            from tierckpt.compat.sagemaker_write import encode_items

            blob, infos = encode_items(list(plan.items), planner, self.rank)
            self._s3_sink().put(self.rank, self.step, CHECKPOINT_FILE, blob)
            if ours is None:
                out.set_result([WriteResult(index=item.index, size_in_bytes=info.length,
                                            storage_data=_BothInfo(None, info))
                                for item, info in zip(plan.items, infos, strict=True)])
            else:
                out.set_result([replace(wr, storage_data=_BothInfo(wr.storage_data, info))
                                for wr, info in zip(ours, infos, strict=True)])
        except (TierckptError, TypeError) as exc:
            out.set_exception(cast(Any, SageMakerS3TierError(
                f"[Rank {self.rank}] Step {self._step}: S3 write failed (memory copy written): {exc}")))
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if not (self.sagemaker_layout and self.save_to_s3):
            super().finish(metadata, results)
            return
        theirs = {wr.index: wr.storage_data.sagemaker for rank_results in results for wr in rank_results}
        if all(wr.storage_data.tierckpt is not None for rank_results in results for wr in rank_results):
            super().finish(metadata, [[replace(wr, storage_data=wr.storage_data.tierckpt) for wr in rank_results]
                                      for rank_results in results])
        elif self.save_id is not None:  # a rank's memory tier failed: no memory commit, S3 alone
            self.runtime.memory.abort(self.step, self.save_id)
        from tierckpt.compat.sagemaker_write import dumps_metadata

        try:
            raw = dumps_metadata(replace(metadata, storage_data=theirs))
            self._s3_sink().put(0, self.step, METADATA_FILE, raw)  # beside rank 0's, as the seed's coordinator
        except StorageError as exc:
            raise DurableWriteError(
                f"S3 metadata of step {self.step} failed (memory copy is committed): {exc}", tier="durable", step=self.step
            ) from exc


class SageMakerTieredStorageReader(TieredStorageReader):
    """``SageMakerTieredStorageReader(checkpoint_config, step=None)``: None loads the newest step
    every rank can load (memory first, then S3); an explicit step loads exactly that step, and
    so does the ``checkpoint_id='.../step_N'`` given to ``dcp.load`` when there is no ``step``.
    ``config=`` is accepted for ``checkpoint_config=`` (the seed's docs use it).

    ``step`` is readable right after construction, as in the seed, and is the loaded step after
    ``dcp.load``. When tierckpt's tiers hold no step (or not the asked-for one) and S3 is
    configured, the step is read from what the SageMaker library itself wrote there, in the
    configured strategy's layout (``tierckpt.compat.legacy``).
    """

    def __init__(
        self, checkpoint_config: SageMakerCheckpointConfig | None = None, step: int | None = None,
        *, config: SageMakerCheckpointConfig | None = None,
    ) -> None:
        checkpoint_config = one_config(checkpoint_config, config)
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise SageMakerTieredStorageError(f"Invalid step value, step:{step}. path:")
        super().__init__(to_tierckpt(checkpoint_config), step=step)
        self.checkpoint_config = checkpoint_config
        self.step = step
        self._legacy: tuple[LegacySource, int, Metadata] | None = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def reset(self, checkpoint_id: Any = None) -> None:
        """``dcp.load(checkpoint_id='.../step_N')`` loads step N unless the reader was given a step."""
        if checkpoint_id is not None and self.requested is None:
            self.requested = self.step = parse_step(checkpoint_id, -1)
        self._legacy = None

    def read_metadata(self) -> Metadata:
        try:
            metadata = super().read_metadata()
        except CheckpointNotFoundError:
            found = self._find_legacy()
            if found is None:
                raise
        else:
            if self.requested is not None:
                return metadata
            # the newest step across both S3 layouts: a namespace written in tierckpt's layout
            # before the default became the library's holds older steps in one, newer in the other
            found = self._find_legacy()
            if found is None or self.step is None or found[1] <= self.step:
                return metadata
        self._legacy, self.step, self.failure = found, found[1], None
        self._log.info(found[1], "Metadata read from a SageMaker checkpointing step on S3 (%s)",
                       found[0].strategy.get_s3_uri(self.config.namespace, 0, found[1], "metadata.metadata"))
        return found[2]

    def _find_legacy(self) -> tuple[LegacySource, int, Metadata] | None:
        strategy = our_strategy(self.checkpoint_config)
        if strategy is None:
            return None
        source = LegacySource(strategy, self.config.namespace, self.config.s3, self.config.logger)
        newest = source.newest(self.requested)
        return None if newest is None else (source, newest[0], newest[1])

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._legacy is None:
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """As the seed: a failure (a read before any step is known included) comes through the future."""
        fut: Future[None] = Future()
        try:
            if self._legacy is not None:
                source, step, metadata = self._legacy
                source.read_items(step, metadata, list(plan.items), planner)
                self.tiers_used[CHECKPOINT_FILE] = "s3 (SageMaker layout)"
                if self.reports_metrics:
                    metrics.dcp_loaded(self.config.namespace, step, 0.0 if self._t_load is None
                                       else time.perf_counter() - self._t_load, ["durable"])
                fut.set_result(None)
                return fut
            if self.step is None or self._manifest is None:
                raise SageMakerTieredStorageError(
                    f"[Rank {self.rank}] Step {self.step}: Step must be set before calling read_data"
                    " (dcp.load calls read_metadata first)"
                )
            return super().read_data(plan, planner)
        except TierckptError as exc:
            fut.set_exception(cast(Any, exc))
        return fut
