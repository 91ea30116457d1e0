"""Lightning: a ``CheckpointIO`` plug-in that saves Trainer checkpoints into tierckpt's tiers.

    from tierckpt.integrations.lightning import TierckptCheckpointIO
    io = TierckptCheckpointIO(tierckpt.CheckpointConfig(namespace="run1", durable_url="file:///ckpt"))
    trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint(every_n_epochs=1, save_top_k=-1)])
    trainer.fit(model, ckpt_path=io.resume_path())    # None on a fresh start, else the newest step
    # asynchronous saves: plugins=[AsyncCheckpointIO(TierckptCheckpointIO(cfg))]

Call order (driven by Lightning's Strategy): ``save_checkpoint`` on global rank 0 only (its
DDP and single-device strategies gather the full state there), each call one step keyed by the
checkpoint's ``global_step``; ``load_checkpoint`` on every rank at resume, where the ranks agree
on one step when a process group is initialized; ``remove_checkpoint`` when ModelCheckpoint
prunes (a no-op: the tiers' retention settings decide what is kept); ``teardown`` at the end.
Lightning's file names (``epoch=1-step=4.ckpt``) name a step; ``tierckpt:latest`` names the
newest loadable step. The plug-in works with ``pytorch_lightning`` (2.x) or the unified
``lightning`` package (preferred when both are installed).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierckpt import layout
from tierckpt.config import CheckpointConfig
from tierckpt.errors import ConfigError
from tierckpt.integrations._tree import load_tree, save_tree
from tierckpt.tiers import Tier, open_durable, open_memory

__all__ = ["LATEST", "TierckptCheckpointIO"]

LATEST = "tierckpt:latest"
_STEP_IN_NAME = re.compile(r"step=(\d+)")
_log = logging.getLogger("tierckpt.integrations.lightning")


def _checkpoint_io_base() -> type:
    try:
        from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    except ImportError:
        try:
            from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
        except ImportError as exc:
            raise ConfigError(
                "the Lightning plug-in needs Lightning: pip install 'tierckpt[lightning]'"
            ) from exc
    return CheckpointIO


if TYPE_CHECKING:
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as _Base
else:
    _Base = _checkpoint_io_base()


class TierckptCheckpointIO(_Base):
    """Lightning checkpoints as tierckpt steps (memory tier, durable tier by the config's policy).

    ``durable``: True/False forces or skips the durable copy of every save; None follows
    ``config.durable_every_n_steps``. Each save returns once the step is committed in memory
    (and durable, when this save goes durable); wrap the plug-in in Lightning's
    ``AsyncCheckpointIO`` to move that off the training loop.
    """

    def __init__(self, config: CheckpointConfig, *, durable: bool | None = None) -> None:
        super().__init__()
        if not isinstance(config, CheckpointConfig):
            raise ConfigError("config must be a tierckpt.CheckpointConfig")
        self.config = config
        self.durable = durable
        self._paths: dict[str, int] = {}  # path Lightning used → step, for this process's saves
        self.saved_steps: list[int] = []
        self.loaded_step: int | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise ConfigError(
                "TierckptCheckpointIO takes no storage_options; set tiers and policy in the CheckpointConfig"
            )
        step = checkpoint.get("global_step")
        if not isinstance(step, int):
            raise ConfigError(f"the checkpoint for {path} has no integer 'global_step'; cannot name its step")
        self._paths[str(path)] = step
        if step in self.saved_steps:  # ModelCheckpoint's "last" copy of a step already saved
            _log.debug("step %d already saved; %s is an alias of it", step, path)
            return
        save_tree(self.config, step, checkpoint, durable=self.durable)
        self.saved_steps.append(step)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        step = self.step_for(path)
        loaded, checkpoint = load_tree(self.config, step)
        self.loaded_step = loaded
        if not isinstance(checkpoint, dict):
            raise ConfigError(f"step {loaded} of {self.config.namespace!r} does not hold a Lightning checkpoint")
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        # The tiers keep memory_steps_retained / durable_steps_retained steps; a pruned name must
        # not delete a step another name (e.g. "last") still refers to.
        _log.debug("remove_checkpoint(%s) ignored: retention is set in the CheckpointConfig", path)

    def step_for(self, path: Any) -> int | None:
        """The step ``path`` names (None for ``tierckpt:latest``); ConfigError when it names none."""
        text = str(path)
        if text == LATEST:
            return None
        if text in self._paths:
            return self._paths[text]
        found = _STEP_IN_NAME.search(Path(text).name)
        if found:
            return int(found.group(1))
        step = layout.step_from_path(text)
        if step is None:
            raise ConfigError(
                f"checkpoint path {text!r} names no step: pass {LATEST!r}, a Lightning file name "
                "with 'step=N', or a path ending in 'step_N'"
            )
        return step

    def resume_path(self) -> str | None:
        """``tierckpt:latest`` when this rank sees a committed step in any tier, else None.

        For ``trainer.fit(model, ckpt_path=io.resume_path())``: a fresh run starts from scratch,
        a restarted one resumes from the newest step all ranks can load.
        """
        # the tiers alone, not a rank runtime: Lightning sets up its process group only in fit()
        tiers: list[Tier | None] = [open_memory(self.config), open_durable(self.config)]
        return LATEST if any(tier.list_steps() for tier in tiers if tier is not None) else None
