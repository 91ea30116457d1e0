"""Loading a checkpoint's non-tensor objects safely: an allow-list, as ``torch.load(weights_only=True)``.

A checkpoint's objects (``BYTE_IO`` items: an lr scheduler's state, a dataloader's position, RNG
state) are pickles. Unpickled in full, a custom class or a ``__reduce__`` runs code in every rank
that loads, so anyone who can write to the bucket or the shared filesystem could run commands in
the training job. Before DCP's planner sees an object's bytes, ``check_object`` unpickles them with
torch's restricted (``weights_only``) unpickler, which admits primitives, containers, tensors and
torch's own types; tierckpt adds numpy scalars and arrays, ``slice``/``range`` and DCP's metadata
types, plus what the caller allows. Anything else is an ``UnsafeObjectError`` naming the class and
the opt-in. Only then is the object handed to the planner (which unpickles it again, now known to
reference nothing outside the allow-list).

Call order: ``TieredStorageReader.read_data`` → per verified byte item ``check_object(raw, ...)``
→ ``planner.load_bytes(...)``.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Iterable
from functools import cache
from typing import Any

import torch

from tierckpt.errors import UnsafeObjectError

__all__ = ["UnsafeObjectError", "check_object", "class_name"]


def class_name(obj: Any) -> str:
    """``module.qualname`` of a class or function, as a pickle names it."""
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', repr(obj)))}"


@cache
def _default_extras() -> tuple[Any, ...]:
    """What tierckpt admits beyond torch's own allow-list: numpy values, slices, DCP metadata."""
    from torch.distributed.checkpoint import metadata as dcp_md

    extras: list[Any] = [slice, range]
    extras += [getattr(dcp_md, n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta",
    ) if hasattr(dcp_md, n)]
    try:
        import numpy as np
    except ImportError:  # no numpy: nothing of it can be in a checkpoint this process saved
        return tuple(extras)
    extras += [np.ndarray, np.dtype]
    core = getattr(np, "_core", None) or np.core
    for fn in ("_reconstruct", "scalar"):
        obj = getattr(core.multiarray, fn)
        # a pickle names the module numpy had when it was written: numpy.core (1.x) or numpy._core (2.x)
        extras += [(obj, f"numpy.core.multiarray.{fn}"), (obj, f"numpy._core.multiarray.{fn}")]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        extras += [t for n in dir(dtypes) if isinstance(t := getattr(dtypes, n), type) and n.endswith("DType")]
    return tuple(extras)


def check_object(
    raw: bytes | memoryview, *, key: str, step: int | None, trusted: bool, allowed: Iterable[Any] = ()
) -> None:
    """Raise UnsafeObjectError unless the pickled object ``raw`` uses only allowed globals.

    ``trusted=True`` skips the check (the checkpoint's writer is trusted); ``allowed`` adds
    classes or functions (objects, as ``torch.serialization.add_safe_globals`` takes them).
    """
    if trusted:
        return
    allowed = tuple(allowed)
    try:
        with torch.serialization.safe_globals([*_default_extras(), *allowed]):
            torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        names = _refused(raw, str(exc), allowed)
        shown = ", ".join(names) if names else "a global outside the allow-list"
        raise UnsafeObjectError(
            f"step {step}: checkpoint object {key!r} references {shown}, which tierckpt does not load by "
            "default (unpickling it could run code); if you trust whoever wrote this checkpoint, pass "
            "trusted=True (CheckpointConfig or Checkpointer.load), or allow the classes with "
            "allowed_classes=(...)",
            names=names, step=step, path=key,
        ) from exc


def _refused(raw: bytes | memoryview, message: str, allowed: tuple[Any, ...] = ()) -> tuple[str, ...]:
    """The globals the restricted unpickler refused, for the error message (best effort).

    What the caller allowed is never listed: naming an allowed class would send the user after
    the wrong object.
    """
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(raw))
    except Exception:  # the message is still useful without the scan
        found = []
    ok = {n for e in (*_default_extras(), *allowed) for n in ([e[1]] if isinstance(e, tuple) else [class_name(e)])}
    names = [n for n in found if n not in ok]
    if not names:
        names = re.findall(r"GLOBAL ([\w.]+)", message)
    return tuple(dict.fromkeys(names))
