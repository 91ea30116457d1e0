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
newest loadable step, and so does ``ckpt_path="last"``: with ``ModelCheckpoint(save_last=True)``
each save of ``last.ckpt`` (``last-vN.ckpt``) writes there a small text pointer (no tensors) that
Lightning's "last" lookup finds, and loading it loads the newest committed step
(``save_last="link"`` is not supported: it links to a file tierckpt never writes).
``weights_only=False`` (Lightning's ``fit(..., weights_only=False)``) loads any object; by default
objects load through tierckpt's allow-list plus the usual hyper-parameter types (paths,
``argparse.Namespace``, ``datetime``), and a save whose checkpoint holds anything else fails at
once with ``UnsaveableObjectError`` naming the key. The plug-in works with ``pytorch_lightning`` (2.x) or the unified
``lightning`` package (preferred when both are installed).
"""

from __future__ import annotations

import json
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
_LAST_NAME = re.compile(r"^last(-v\d+)?\.ckpt$")  # ModelCheckpoint's save_last names
_POINTER = "tierckpt-pointer"
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
        self._checked_fresh_start = False

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise ConfigError(
                "TierckptCheckpointIO takes no storage_options; set tiers and policy in the CheckpointConfig"
            )
        step = checkpoint.get("global_step")
        if not isinstance(step, int):
            raise ConfigError(f"the checkpoint for {path} has no integer 'global_step'; cannot name its step")
        self._paths[str(path)] = step
        if _LAST_NAME.match(Path(str(path)).name):
            self._write_pointer(Path(str(path)), step)
        if step in self.saved_steps:  # ModelCheckpoint's "last" copy of a step already saved
            _log.debug("step %d already saved; %s is an alias of it", step, path)
            return
        self._warn_if_overwriting(step)
        save_tree(self.config, step, checkpoint, durable=self.durable)
        self.saved_steps.append(step)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint ``path`` names; ``weights_only=False`` loads any object, as ``torch.load`` would."""
        step = self.step_for(path)
        loaded, checkpoint = load_tree(self.config, step, trusted=True if weights_only is False else None)
        self.loaded_step = loaded
        if not isinstance(checkpoint, dict):
            raise ConfigError(f"step {loaded} of {self.config.namespace!r} does not hold a Lightning checkpoint")
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        # The tiers keep memory_steps_retained / durable_steps_retained steps; a pruned name must
        # not delete a step another name (e.g. "last") still refers to. Only a pointer goes.
        if self._is_pointer(Path(str(path))):
            Path(str(path)).unlink(missing_ok=True)
            return
        _log.debug("remove_checkpoint(%s) ignored: retention is set in the CheckpointConfig", path)

    def _warn_if_overwriting(self, step: int) -> None:
        """Once per plug-in: a run that did not resume is about to save over an earlier run's steps."""
        if self._checked_fresh_start or self.loaded_step is not None:
            return
        self._checked_fresh_start = True
        tiers: list[Tier | None] = [open_memory(self.config), open_durable(self.config)]
        earlier = sorted({s.step for tier in tiers if tier is not None for s in tier.list_steps() if s.step >= step})
        if earlier:
            _log.warning(
                "namespace %r already holds step(s) %s from an earlier run, and this Trainer did not resume: "
                "its saves replace them. To resume, pass ckpt_path=%r (or io.resume_path(), or \"last\" with "
                "ModelCheckpoint(save_last=True)); to start over, use a new namespace",
                self.config.namespace, earlier, LATEST,
            )

    def _write_pointer(self, path: Path, step: int) -> None:
        """``last.ckpt`` for Lightning's ``ckpt_path="last"`` lookup: text, never a torch checkpoint."""
        if "://" in str(path):
            _log.warning("%s is not a local path: no pointer written; resume with ckpt_path=%r", path, LATEST)
            return
        body = {_POINTER: 1, "namespace": self.config.namespace, "step_when_written": step,
                "loads": "the newest committed step (tierckpt.integrations.lightning)"}
        path.parent.mkdir(parents=True, exist_ok=True)
        layout.write_atomic(path, json.dumps(body) + "\n")

    @staticmethod
    def _is_pointer(path: Path) -> bool:
        try:
            with path.open("rb") as f:
                return f.read(len(_POINTER) + 2) == f'{{"{_POINTER}'.encode()[: len(_POINTER) + 2]
        except OSError:
            return False

    def step_for(self, path: Any) -> int | None:
        """The step ``path`` names (None for ``tierckpt:latest``); ConfigError when it names none."""
        text = str(path)
        if text == LATEST or _LAST_NAME.match(Path(text).name):
            return None  # "last": the newest committed step, whichever run saved it
        if text in self._paths:
            return self._paths[text]
        found = _STEP_IN_NAME.search(Path(text).name)
        if found:
            return int(found.group(1))
        step = layout.step_from_path(text)
        if step is None:
            raise ConfigError(
                f"checkpoint path {text!r} names no step: pass {LATEST!r}, 'last' (with "
                "ModelCheckpoint(save_last=True)), a Lightning file name with 'step=N', or a path ending in 'step_N'"
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
