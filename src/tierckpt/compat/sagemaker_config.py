"""The SageMaker-compatible API's configuration: the seed's config, its checks and errors, and
the translation to a tierckpt ``CheckpointConfig`` (``tierckpt.compat.sagemaker`` re-exports it).

Call order: the writer or reader takes the config (``checkpoint_config=`` or ``config=``:
``one_config``), checks it with the seed's rules and messages (``validated``, inside
``to_tierckpt``) and builds its tierckpt config (``to_tierckpt``); the writer resolves its step
with ``parse_step``; S3 access goes through ``our_strategy``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

from tierckpt import layout
from tierckpt.compat.sagemaker_paths import (
    DefaultS3PathStrategy,
    RayS3PathStrategy,
    S3PathStrategy,
    detect_default_strategy,
)
from tierckpt.config import DEFAULT_MEMORY_DIR, CheckpointConfig, DurableLocation, S3Settings
from tierckpt.errors import ConfigError, StorageError, TierckptError

__all__ = [
    "S3_LAYOUTS",
    "SageMakerCheckpointConfig",
    "SageMakerInMemoryTierError",
    "SageMakerS3TierError",
    "SageMakerTieredStorageConfigError",
    "SageMakerTieredStorageError",
    "one_config",
    "our_strategy",
    "parse_step",
    "tierckpt_step_dir",
    "to_tierckpt",
    "validated",
]

_SEED_STEPS_RETAINED = 3  # the seed's memory service keeps the newest 3 steps
S3_LAYOUTS = ("tierckpt", "sagemaker")


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
    ``s3_path_strategy``: a ``DefaultS3PathStrategy`` / ``RayS3PathStrategy`` (from this module or
    the seed's), or any object with a ``base_path``; without one, ``s3_tier_base_path`` picks
    Ray's inside Ray Train, else the default, as the seed does. By default (``s3_layout=
    "sagemaker"``) the writer puts the strategy's layout on S3, as the seed; with
    ``s3_layout="tierckpt"`` it writes tierckpt's own ``<base>/<namespace>/step_<N>/`` layout.
    ``memory_dir``: the node-local memory tier; ``s3``: endpoint, credentials, part size and
    retry overrides (None fields come from the standard AWS variables). ``s3_layout``: what the
    writer puts on S3, ``"sagemaker"`` (the default: the library's ``checkpoint.pt`` +
    ``metadata.metadata`` in the strategy's layout, readable by ``amzn-sagemaker-checkpointing``)
    or ``"tierckpt"`` (its own layout, plain DCP per step); the reader reads both either way.
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
    s3_layout: str = "sagemaker"

    def __post_init__(self) -> None:
        if self.s3_layout not in S3_LAYOUTS:
            raise SageMakerTieredStorageConfigError(
                f"s3_layout must be one of {', '.join(map(repr, S3_LAYOUTS))}, got {self.s3_layout!r}"
            )
        if self.s3_tier_base_path and self.s3_path_strategy:
            raise ValueError(
                "Cannot specify both s3_tier_base_path and s3_path_strategy. Use one or the other."
            )

    def get_s3_strategy(self) -> Any:
        """The explicit strategy, else one detected for ``s3_tier_base_path``, else None."""
        if self.s3_path_strategy:
            return self.s3_path_strategy
        if self.s3_tier_base_path:
            return detect_default_strategy(self.s3_tier_base_path, self.logger)
        return None


def tierckpt_step_dir(base_path: str, namespace: str, step: int) -> str:
    """Where tierckpt puts a step on S3: ``<base_path>/<namespace>/step_<N>``."""
    return f"{base_path.rstrip('/')}/{namespace}/{layout.step_dir_name(step)}"


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


def one_config(checkpoint_config: Any, config: Any) -> SageMakerCheckpointConfig:
    """The config passed as ``checkpoint_config`` (the library's keyword) or ``config`` (its docs')."""
    if checkpoint_config is not None and config is not None:
        raise SageMakerTieredStorageConfigError("pass the SageMakerCheckpointConfig once: checkpoint_config= or config=")
    chosen = checkpoint_config if checkpoint_config is not None else config
    if chosen is None:
        raise SageMakerTieredStorageConfigError(
            "checkpoint_config must be a SageMakerCheckpointConfig (pass it first, or as checkpoint_config=)"
        )
    return cast(SageMakerCheckpointConfig, chosen)


def our_strategy(config: SageMakerCheckpointConfig) -> S3PathStrategy | None:
    """The configured strategy as one of this module's classes (the seed's own ones are accepted)."""
    strategy = config.get_s3_strategy()
    if strategy is None or isinstance(strategy, S3PathStrategy):
        return strategy
    cls = RayS3PathStrategy if type(strategy).__name__ == "RayS3PathStrategy" else DefaultS3PathStrategy
    return cls(str(strategy.base_path))
