"""The private torch names tierckpt relies on, in one place, each checked when imported.

``torch.distributed.checkpoint`` keeps a few useful pieces behind underscores:

    _StorageInfo          filesystem.py: (relative_path, offset, length[, transform_descriptors]),
                          the storage_data of every item in a FileSystemReader-compatible
                          ``.metadata``; tierckpt writes it so plain DCP reads tierckpt's files
    flatten_state_dict    _nested_dict.py: a nested state dict → {dotted fqn: leaf}, mapping

Torch may move or reshape them in any release. Everything else in tierckpt imports them from
here; ``check()`` (run at import) verifies their shape and raises ``TorchCompatError`` naming
the torch version and what changed, so a changed torch fails at import with one clear message
instead of a corrupt ``.metadata`` later. ``flatten_state_dict`` has a pure-Python fallback
that follows DCP's rules (dict keys joined with ``.``, lists/tuples indexed), used only when the
private module is gone. ``_StorageInfo`` has none: a checkpoint that plain DCP reads needs
torch's own class, so its absence is an error.

``TESTED`` is the torch range these checks were written against (tests/unit/test_hardening.py
fails loudly when the installed torch is newer and a check no longer holds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from tierckpt.errors import TierckptError

__all__ = ["TESTED", "StorageInfo", "TorchCompatError", "check", "flatten_state_dict"]

TESTED = ("2.4", "2.13")  # oldest and newest torch minor versions these checks were written for

_STORAGE_INFO_FIELDS = ("relative_path", "offset", "length")


class TorchCompatError(TierckptError, ImportError):
    """The installed torch changed a private API tierckpt depends on."""


def _load_storage_info() -> type[Any]:
    try:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
    except ImportError as exc:
        raise TorchCompatError(
            f"torch {torch.__version__} has no torch.distributed.checkpoint.filesystem._StorageInfo "
            f"(tierckpt was checked against torch {TESTED[0]}-{TESTED[1]}); install a torch in that "
            "range or a tierckpt release that supports this torch"
        ) from exc
    return _StorageInfo


def _fallback_flatten(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[str | int, ...]]]:
    """DCP's flattening rules without its private module: nested dicts and lists become dotted keys."""
    flat: dict[str, Any] = {}
    mapping: dict[str, tuple[str | int, ...]] = {}

    def visit(path: tuple[str | int, ...], value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for key, child in value.items():
                visit((*path, str(key)), child)
        elif isinstance(value, (list, tuple)) and value and any(isinstance(v, torch.Tensor) for v in value):
            for index, child in enumerate(value):
                visit((*path, index), child)
        else:
            fqn = ".".join(str(p) for p in path)
            flat[fqn] = value
            mapping[fqn] = path

    for key, value in state_dict.items():
        visit((str(key),), value)
    return flat, mapping


def _load_flatten() -> Any:
    try:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten
    except ImportError:
        return _fallback_flatten
    return flatten


if TYPE_CHECKING:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
else:
    StorageInfo = _load_storage_info()
    flatten_state_dict = _load_flatten()


def check() -> None:
    """Verify the private names still have the shape tierckpt writes and reads; raise if not."""
    if not (isinstance(StorageInfo, type) and dataclasses.is_dataclass(StorageInfo)):
        raise TorchCompatError(f"torch {torch.__version__}: _StorageInfo is no longer a dataclass")
    names = tuple(f.name for f in dataclasses.fields(StorageInfo))
    if names[: len(_STORAGE_INFO_FIELDS)] != _STORAGE_INFO_FIELDS:
        raise TorchCompatError(
            f"torch {torch.__version__}: _StorageInfo's fields are {names}, tierckpt expects "
            f"{_STORAGE_INFO_FIELDS} first; this torch is not supported yet"
        )
    probe = StorageInfo("f", 1, 2)
    if (probe.relative_path, probe.offset, probe.length) != ("f", 1, 2):
        raise TorchCompatError(f"torch {torch.__version__}: _StorageInfo(path, offset, length) changed meaning")
    flat, mapping = flatten_state_dict({"a": {"b": 1}, "c": 2})
    if flat != {"a.b": 1, "c": 2} or mapping.get("a.b") != ("a", "b"):
        raise TorchCompatError(
            f"torch {torch.__version__}: flatten_state_dict now returns {flat!r} / {mapping!r}; "
            "tierckpt expects dotted keys and key paths"
        )


check()
