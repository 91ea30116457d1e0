"""The SageMaker-compatible API's configuration: the seed's config, its checks and errors, and
the translation to a tierckpt ``CheckpointConfig`` (``tierckpt.compat.sagemaker`` re-exports it); seed
000's spelling, ``CheckpointConfig(in_memory_namespace=..., s3_base_path=..., s3_every_n_steps=...)``,
is the SageMaker config under other names (not ``tierckpt.CheckpointConfig``).

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
from tierckpt.config import MEMORY_DIR_UNSET, DurableLocation, S3Settings
from tierckpt.config import CheckpointConfig as TierckptConfig
from tierckpt.errors import ConfigError, StorageError, TierckptError

__all__ = [
    "S3_LAYOUTS",
    "CheckpointConfig",
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
    ``memory_dir``: the node-local memory tier (default /dev/shm/tierckpt, or ``tierckpt run
    --memory-dir`` under the launcher); ``s3``: endpoint, credentials, part size and
    retry overrides (None fields come from the standard AWS variables). ``s3_every_n_steps``
    (seed 000's setting): a step whose number it divides goes to S3 too, as if ``save_to_s3``
    were set for it; 0 (the default) leaves the choice to ``save_to_s3``. ``s3_layout``: what the
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
    memory_dir: str = MEMORY_DIR_UNSET
    s3: S3Settings | None = None
    s3_layout: str = "sagemaker"
    s3_every_n_steps: int = 0

    def __post_init__(self) -> None:
        every = self.s3_every_n_steps
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise SageMakerTieredStorageConfigError(
                f"s3_every_n_steps must be a whole number >= 0 (0: only when save_to_s3 is set), got {every!r}"
            )
        if self.s3_layout not in S3_LAYOUTS:
            raise SageMakerTieredStorageConfigError(
                f"s3_layout must be one of {', '.join(map(repr, S3_LAYOUTS))}, got {self.s3_layout!r}"
            )
        if self.s3_tier_base_path and self.s3_path_strategy:
            raise ValueError(
                "Cannot specify both s3_tier_base_path and s3_path_strategy. Use one or the other."
            )

    def saves_to_s3(self, step: int) -> bool:
        """Whether step ``step`` goes to S3: ``save_to_s3``, or ``s3_every_n_steps`` divides it."""
        return bool(self.save_to_s3) or (self.s3_every_n_steps > 0 and step % self.s3_every_n_steps == 0)

    def get_s3_strategy(self) -> Any:
        """The explicit strategy, else one detected for ``s3_tier_base_path``, else None."""
        if self.s3_path_strategy:
            return self.s3_path_strategy
        if self.s3_tier_base_path:
            return detect_default_strategy(self.s3_tier_base_path, self.logger)
        return None


class CheckpointConfig(SageMakerCheckpointConfig):
    """Seed 000's spelling of the config (the set-up page's ``CheckpointConfig``), keyword-only:

        CheckpointConfig(world_size=..., in_memory_namespace="my-ml-workload",
                         s3_base_path="s3://bucket/prefix/", s3_every_n_steps=100)

    ``in_memory_namespace`` is ``namespace``, ``s3_base_path`` is ``s3_tier_base_path`` (either
    spelling, not both); every other field is ``SageMakerCheckpointConfig``'s, under its own
    name. It is a ``SageMakerCheckpointConfig``: the writer and reader take it as they take one,
    and ``in_memory_namespace`` / ``s3_base_path`` read and set the same fields afterwards.
    """

    def __init__(
        self, *, world_size: int, in_memory_namespace: str | None = None, namespace: str | None = None,
        s3_base_path: str | None = None, s3_tier_base_path: str | None = None, s3_every_n_steps: int = 0,
        s3_path_strategy: Any = None, save_to_s3: bool = False, logger: logging.Logger | None = None,
        disk_tier_base_path: str = "", save_to_disk: bool = False, memory_dir: str = MEMORY_DIR_UNSET,
        s3: S3Settings | None = None, s3_layout: str = "sagemaker",
    ) -> None:
        super().__init__(
            namespace=_one_of("in_memory_namespace", in_memory_namespace, "namespace", namespace) or "",
            world_size=world_size, disk_tier_base_path=disk_tier_base_path,
            s3_tier_base_path=_one_of("s3_base_path", s3_base_path, "s3_tier_base_path", s3_tier_base_path) or "",
            s3_path_strategy=s3_path_strategy, save_to_s3=save_to_s3, save_to_disk=save_to_disk, logger=logger,
            memory_dir=memory_dir, s3=s3, s3_layout=s3_layout, s3_every_n_steps=s3_every_n_steps,
        )

    @property
    def in_memory_namespace(self) -> str:
        """Seed 000's name for ``namespace``."""
        return self.namespace

    @in_memory_namespace.setter
    def in_memory_namespace(self, value: str) -> None:
        self.namespace = value

    @property
    def s3_base_path(self) -> str:
        """Seed 000's name for ``s3_tier_base_path``."""
        return self.s3_tier_base_path

    @s3_base_path.setter
    def s3_base_path(self, value: str) -> None:
        self.s3_tier_base_path = value


def _one_of(seed_name: str, seed_value: str | None, name: str, value: str | None) -> str | None:
    if seed_value is not None and value is not None:
        raise SageMakerTieredStorageConfigError(f"pass {seed_name}= or {name}=, not both (they are the same field)")
    return seed_value if seed_value is not None else value


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
    if config.s3_every_n_steps and base is None:
        raise SageMakerTieredStorageConfigError(
            f"s3_every_n_steps={config.s3_every_n_steps} but no S3 path configured. "
            "Set s3_base_path (s3_tier_base_path) or s3_path_strategy."
        )
    if base is not None and not base.startswith("s3://"):
        raise SageMakerTieredStorageConfigError("Invalid S3 tier base path, should start with s3://")
    return config


def to_tierckpt(config: SageMakerCheckpointConfig) -> TierckptConfig:
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
        return TierckptConfig(
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
