"""Save and load an arbitrary checkpoint object (nested dicts, lists, tensors, plain values) as one step.

Frameworks such as Lightning hand the checkpoint IO a nested object and expect the same object
back from a load, with no template to load into. DCP needs a template for tensors, and its own
flattening turns integer-keyed dicts (optimizer state) into lists. So the object is split:

    skeleton   the object with every tensor replaced by a ``TensorRef`` (one DCP bytes item)
    tensors    a flat ``{key: tensor}`` dict, one DCP tensor item each (raw bytes in the tiers)

Non-tensor values load through tierckpt's allow-list (``tierckpt.dcp.safeload``) plus the
types frameworks put in hyper-parameters (``HPARAM_CLASSES``: paths, ``argparse.Namespace``,
``datetime`` values); ``save_tree`` refuses, naming the key, a value that such a load would
refuse, so the failure comes at save time and not at the resume after a crash.

Call order of ``save_tree``: (1) split, (2) check the skeleton loads (unless trusted),
(3) ``dcp.save`` of the skeleton and the tensors from this process alone.
Call order of ``load_tree``: (1) load the skeleton alone (this is where the ranks agree on a
step when the load is collective), (2) allocate one empty tensor per ``TensorRef`` and load those
from the same step, (3) put the tensors back into the skeleton. Each step stays a plain DCP
checkpoint: ``dcp.load`` of ``{TREE_KEY: None}`` and the tensor keys reads it without tierckpt.
"""

from __future__ import annotations

import argparse
import datetime
import io
import pathlib
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tierckpt.config import CheckpointConfig
from tierckpt.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt.dcp.safeload import check_object, class_name
from tierckpt.errors import StateDictMismatchError, TierckptError, UnsafeObjectError, UnsaveableObjectError

__all__ = ["HPARAM_CLASSES", "TREE_KEY", "TensorRef", "check_loadable", "join", "load_tree", "save_tree", "split"]

TREE_KEY = "__tierckpt_tree__"
#: what hyper-parameters commonly hold beyond plain data; loaded by default (no code runs on load)
HPARAM_CLASSES: tuple[Any, ...] = (
    pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.Path, pathlib.PosixPath,
    pathlib.WindowsPath, argparse.Namespace, datetime.datetime, datetime.date, datetime.time,
    datetime.timedelta, datetime.timezone,
)


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor stood in the skeleton: its key among the tensor items, shape and dtype."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _Skeleton:
    """The skeleton as one opaque DCP bytes item (DCP would flatten a bare dict into many)."""

    tree: Any


def split(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(skeleton, tensors)``: tensors keyed by their dotted path in ``obj`` (made unique)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: tuple[str, ...]) -> Any:
        if isinstance(node, torch.Tensor):
            key = ".".join(path) or "tensor"
            if key in tensors or key == TREE_KEY:
                key = f"{key}#{len(tensors)}"
            tensors[key] = node.detach()
            return TensorRef(key, tuple(node.shape), node.dtype)
        if isinstance(node, dict):
            out = {k: walk(v, (*path, str(k))) for k, v in node.items()}
            return type(node)(out) if type(node) is not dict else out  # keeps OrderedDict
        if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            items = [walk(v, (*path, str(i))) for i, v in enumerate(node)]
            return items if isinstance(node, list) else tuple(items)
        return node

    return walk(obj, ()), tensors


def join(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of ``split``: every ``TensorRef`` replaced by its loaded tensor."""

    def walk(node: Any) -> Any:
        if isinstance(node, TensorRef):
            return tensors[node.key]
        if isinstance(node, dict):
            out = {k: walk(v) for k, v in node.items()}
            return type(node)(out) if type(node) is not dict else out
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, tuple) and not hasattr(node, "_fields"):
            return tuple(walk(v) for v in node)
        return node

    return walk(skeleton)


def _allowed(config: CheckpointConfig, extra: Iterable[Any] = ()) -> tuple[Any, ...]:
    return (TensorRef, _Skeleton, *HPARAM_CLASSES, *config.allowed_classes, *extra)


def _leaves(node: Any, path: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, (*path, str(k)))
    elif isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
        for i, v in enumerate(node):
            yield from _leaves(v, (*path, str(i)))
    elif not isinstance(node, TensorRef):
        yield ".".join(path), node


def _pickled(obj: Any) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out)  # as DCP writes a bytes item
    return out.getvalue()


def check_loadable(config: CheckpointConfig, step: int, skeleton: Any) -> None:
    """Raise UnsaveableObjectError, naming the key, when a default load would refuse a value of ``skeleton``."""
    if config.trusted:
        return
    allowed = _allowed(config)
    try:
        check_object(_pickled(_Skeleton(skeleton)), key=TREE_KEY, step=step, trusted=False, allowed=allowed)
    except UnsafeObjectError as whole:
        for key, value in _leaves(skeleton, ()):
            try:
                check_object(_pickled(value), key=key, step=step, trusted=False, allowed=allowed)
            except UnsafeObjectError as exc:
                names = ", ".join(exc.names) or class_name(type(value))
                raise UnsaveableObjectError(
                    f"step {step}: checkpoint value {key!r} references {names}, which a resume would refuse "
                    "to load (unpickling it could run code); store plain data instead, or allow it: "
                    f"CheckpointConfig(allowed_classes=({type(value).__name__}, ...)), or trusted=True if you "
                    "trust everyone who can write the checkpoints",
                    key=key, step=step,
                ) from exc
        raise UnsaveableObjectError(f"step {step}: {whole}", key=None, step=step) from whole


def save_tree(config: CheckpointConfig, step: int, obj: Any, *, durable: bool | None = None) -> None:
    """Save ``obj`` as ``step`` from this process alone (no collective), memory commit included.

    Frameworks that save on global rank 0 only (Lightning's DDP, Ray's rank-0 reporting) call this
    there; the durable copy follows ``config.durable_every_n_steps`` unless ``durable`` forces it.
    A value a default ``load_tree`` would refuse is an UnsaveableObjectError naming its key.
    """
    skeleton, tensors = split(obj)
    check_loadable(config, step, skeleton)
    state: dict[str, Any] = {TREE_KEY: _Skeleton(skeleton), **tensors}
    writer = TieredStorageWriter(config, step=step, durable=durable)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_save(state, storage_writer=writer, no_dist=True)
    except CheckpointException as exc:
        cause = dcp_cause(exc)
        if isinstance(cause, TierckptError):
            raise cause from exc
        raise TierckptError(f"saving step {step} of namespace {config.namespace!r} failed: {cause}") from exc


def load_tree(
    config: CheckpointConfig, step: int | None = None, *, collective: bool | None = None,
    trusted: bool | None = None, allowed_classes: Iterable[Any] = (),
) -> tuple[int, Any]:
    """``(step, obj)`` of the newest loadable step (or ``step``); raises CheckpointNotFoundError.

    ``collective`` (default: whether a process group is initialized): every rank calls this and
    the ranks agree on one step through the reader, so no rank resumes from another step.
    ``trusted`` (default: the config's) loads any object; ``allowed_classes`` adds to the
    allow-list (which holds ``HPARAM_CLASSES`` and the config's ``allowed_classes`` already).
    """
    together = dist.is_available() and dist.is_initialized() if collective is None else collective
    head: dict[str, Any] = {TREE_KEY: None}
    reader = TieredStorageReader(config, step, single_process=not together, partial=True, trusted=trusted,
                                 allowed_classes=_allowed(config, allowed_classes))
    reader.reports_metrics = False  # one load, one report: the tensors' read (or the end) reports it
    try:
        _load(head, reader, together)
    except CheckpointException as exc:  # no tierckpt error inside: DCP's planner found no (bytes) tree item
        raise StateDictMismatchError(
            f"step {reader.step} of namespace {config.namespace!r} was not saved by save_tree "
            "(a framework integration); load it with Checkpointer.load or dcp.load instead"
        ) from exc
    chosen = reader.step
    if chosen is None:  # the reader sets it before any read; a None here is a reader bug
        raise TierckptError("the reader loaded a checkpoint without naming its step")
    wrapped = head[TREE_KEY]
    if not isinstance(wrapped, _Skeleton):
        raise StateDictMismatchError(
            f"step {chosen} of namespace {config.namespace!r} was not saved by save_tree "
            "(a framework integration); load it with Checkpointer.load or dcp.load instead"
        )
    skeleton = wrapped.tree
    refs: dict[str, TensorRef] = {}
    join_refs(skeleton, refs)
    tensors = {k: torch.empty(r.shape, dtype=r.dtype) for k, r in refs.items()}
    if not tensors:
        reader.reports_metrics = True
        reader.report_load()
    else:
        try:
            _load(tensors, TieredStorageReader(config, chosen, single_process=not together, partial=True), together)
        except CheckpointException as exc:
            raise StateDictMismatchError(
                f"step {chosen} of namespace {config.namespace!r}: its tensors do not match its tree ({exc})"
            ) from exc
    return chosen, join(skeleton, tensors)


def join_refs(skeleton: Any, refs: dict[str, TensorRef]) -> None:
    """Collect every ``TensorRef`` of ``skeleton`` into ``refs`` (key → ref)."""
    if isinstance(skeleton, TensorRef):
        refs[skeleton.key] = skeleton
    elif isinstance(skeleton, dict):
        for value in skeleton.values():
            join_refs(value, refs)
    elif isinstance(skeleton, (list, tuple)):
        for value in skeleton:
            join_refs(value, refs)


def _load(state: dict[str, Any], reader: TieredStorageReader, together: bool) -> None:
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(state, storage_reader=reader, no_dist=not together)
    except CheckpointException as exc:
        cause = reader.failure or dcp_cause(exc)
        if isinstance(cause, TierckptError):
            raise cause from exc
        raise  # the caller names what a DCP-level failure means here


def dcp_cause(exc: CheckpointException) -> BaseException:
    """The tierckpt error a rank raised inside DCP, else the first rank's own error."""
    causes = [f[0] if isinstance(f, tuple) else f for _, f in sorted(exc.failures.items())]
    for cause in causes:
        if isinstance(cause, TierckptError):
            return cause
    return causes[0] if causes else exc
