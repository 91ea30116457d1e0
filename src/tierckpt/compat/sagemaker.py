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
memory service; the S3 tier is tierckpt's durable tier at ``<s3_tier_base_path>/<namespace>/
step_<N>/`` (plain DCP per step). ``save_to_s3`` is read once, when a writer is built, so changing
it for the next step cannot affect a save still in flight. The seed's validation messages are
kept; its errors derive from ``tierckpt.TierckptError`` as well.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tierckpt import layout
from tierckpt.config import DEFAULT_MEMORY_DIR, CheckpointConfig, DurableLocation, S3Settings
from tierckpt.dcp.reader import TieredStorageReader
from tierckpt.dcp.writer import TieredStorageWriter
from tierckpt.errors import ConfigError, StorageError, TierckptError

__all__ = [
    "SageMakerCheckpointConfig",
    "SageMakerInMemoryTierError",
    "SageMakerS3TierError",
    "SageMakerTieredStorageConfigError",
    "SageMakerTieredStorageError",
    "SageMakerTieredStorageReader",
    "SageMakerTieredStorageWriter",
]

_SEED_STEPS_RETAINED = 3  # the seed's memory service keeps the newest 3 steps


class SageMakerTieredStorageError(TierckptError):
    """Root of the SageMaker-compatible errors."""


class SageMakerInMemoryTierError(SageMakerTieredStorageError):
    """The memory tier failed."""


class SageMakerS3TierError(SageMakerTieredStorageError, StorageError):
    """The S3 tier failed, or its path is unusable."""


class SageMakerTieredStorageConfigError(SageMakerTieredStorageError, ConfigError):
    """The SageMakerCheckpointConfig is invalid."""


@dataclass
class SageMakerCheckpointConfig:
    """The seed's config (mutable, like the seed's), plus two tierckpt fields at the end.

    ``disk_tier_base_path`` and ``save_to_disk`` are accepted and unused, as in the seed.
    ``s3_path_strategy`` may be any object with a ``base_path`` (the seed's strategy classes);
    tierckpt always uses the ``<base>/<namespace>/step_<N>/`` layout.
    ``memory_dir``: the node-local memory tier; ``s3``: endpoint, credentials, part size and
    retry overrides (None fields come from the standard AWS variables).
    """

    namespace: str
    world_size: int
    disk_tier_base_path: str = ""
    s3_tier_base_path: str = ""
    s3_path_strategy: Any = None
    save_to_s3: bool = False
    save_to_disk: bool = False
    logger: logging.Logger | None = None
    memory_dir: str = DEFAULT_MEMORY_DIR
    s3: S3Settings | None = None

    def __post_init__(self) -> None:
        if self.s3_tier_base_path and self.s3_path_strategy:
            raise ValueError(
                "Cannot specify both s3_tier_base_path and s3_path_strategy. Use one or the other."
            )

    def get_s3_strategy(self) -> Any:
        """The explicit strategy, else one for ``s3_tier_base_path``, else None."""
        if self.s3_path_strategy is not None:
            return self.s3_path_strategy
        if self.s3_tier_base_path:
            return S3BasePath(self.s3_tier_base_path)
        return None


@dataclass(frozen=True)
class S3BasePath:
    """tierckpt's one S3 layout: ``<base_path>/<namespace>/step_<N>/``."""

    base_path: str

    def get_checkpoint_dir(self, namespace: str, step: int) -> str:
        return f"{self.base_path.rstrip('/')}/{namespace}/{layout.step_dir_name(step)}"


def _base_path(config: SageMakerCheckpointConfig) -> str | None:
    strategy = config.get_s3_strategy()
    return None if strategy is None else str(getattr(strategy, "base_path", strategy))


def validated(config: SageMakerCheckpointConfig) -> SageMakerCheckpointConfig:
    """The seed's checks, in its order and with its messages; returns the same object."""
    if not isinstance(config, SageMakerCheckpointConfig):
        raise SageMakerTieredStorageConfigError("checkpoint_config must be a SageMakerCheckpointConfig")
    if not config.namespace:
        raise SageMakerTieredStorageConfigError("Namespace in SageMakerCheckpointConfig cannot be empty")
    if isinstance(config.world_size, bool) or not isinstance(config.world_size, int):
        raise TypeError(f"world_size must be an int, got {type(config.world_size).__name__}")
    if config.world_size <= 0:
        raise SageMakerTieredStorageConfigError(
            f"Invalid world size:{config.world_size}, expecting a positive integer"
        )
    base = _base_path(config)
    if config.save_to_s3 and base is None:
        raise SageMakerTieredStorageConfigError(
            "S3 save enabled but no S3 path configured. Set s3_tier_base_path or s3_path_strategy."
        )
    if base is not None and not base.startswith("s3://"):
        raise SageMakerTieredStorageConfigError("Invalid S3 tier base path, should start with s3://")
    return config


def to_tierckpt(config: SageMakerCheckpointConfig) -> CheckpointConfig:
    """The tierckpt config a SageMaker config stands for (validated first)."""
    validated(config)
    base = _base_path(config)
    durable_url = None
    if base is not None:
        if not base[len("s3://") :].split("/", 1)[0]:
            raise SageMakerS3TierError("Invalid S3 path: bucket name is empty")
        durable_url = base.rstrip("/")
        try:
            DurableLocation.parse(durable_url)
        except ConfigError as exc:
            raise SageMakerTieredStorageConfigError(str(exc)) from exc
    try:
        return CheckpointConfig(
            namespace=config.namespace,
            memory_dir=config.memory_dir,
            durable_url=durable_url,
            memory_steps_retained=_SEED_STEPS_RETAINED,
            durable_every_n_steps=0,  # the durable copy happens exactly when save_to_s3 says
            s3=config.s3 or S3Settings(),
            logger=config.logger,
        )
    except ConfigError as exc:
        raise SageMakerTieredStorageConfigError(str(exc)) from exc


def parse_step(path: Any, step: int) -> int:
    """The seed's rule: an explicit ``step`` (not -1) wins; else ``step_<N>`` in ``path``.

    Every path the seed accepts gives the seed's step (the text after the first ``step_`` up to
    the next ``/``); paths it rejected are tried with tierckpt's rule (the last ``step_<N>``
    component), so ``my_step_dir/step_5`` works here.
    """
    value = step
    if step == -1 and "step_" in str(path):
        text = str(path)
        try:
            value = int(text[text.index("step_") + len("step_") :].split("/", 1)[0])
        except ValueError:
            found = layout.step_from_path(text)
            value = -1 if found is None else found
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SageMakerTieredStorageError(f"Invalid step value, step:{value}. path:{path}")
    return value


class SageMakerTieredStorageWriter(TieredStorageWriter):
    """``SageMakerTieredStorageWriter(checkpoint_config, path="", step=-1)``: one step's save.

    Every save goes to the memory tier; it also goes to S3 when ``checkpoint_config.save_to_s3``
    is set at construction. ``checkpoint_id`` given to ``dcp.save`` is ignored, as in the seed.
    """

    def __init__(self, checkpoint_config: SageMakerCheckpointConfig, path: Any = "", step: int = -1) -> None:
        resolved = parse_step(path, step)  # the seed checks the step before the config
        super().__init__(to_tierckpt(checkpoint_config), step=resolved, durable=bool(checkpoint_config.save_to_s3))
        self.checkpoint_config = checkpoint_config
        self.save_to_s3 = bool(checkpoint_config.save_to_s3)

    @property
    def s3_checkpoint_dir(self) -> str | None:
        """Where this step's S3 copy lives, or None without S3."""
        base = _base_path(self.checkpoint_config)
        return None if base is None else S3BasePath(base).get_checkpoint_dir(self.config.namespace, self.step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(None)  # the step is fixed at construction


class SageMakerTieredStorageReader(TieredStorageReader):
    """``SageMakerTieredStorageReader(checkpoint_config, step=None)``: None loads the newest step
    every rank can load (memory first, then S3); an explicit step loads exactly that step."""

    def __init__(self, checkpoint_config: SageMakerCheckpointConfig, step: int | None = None) -> None:
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise SageMakerTieredStorageError(f"Invalid step value, step:{step}. path:")
        super().__init__(to_tierckpt(checkpoint_config), step=step)
        self.checkpoint_config = checkpoint_config

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(None)
