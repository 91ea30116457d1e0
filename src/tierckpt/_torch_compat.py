"""The private torch names tierckpt relies on, in one place, each checked when imported.

``torch.distributed.checkpoint`` keeps a few useful pieces behind underscores:

    _StorageInfo          filesystem.py: (relative_path, offset, length[, transform_descriptors]),
                          the storage_data of every item in a FileSystemReader-compatible
                          ``.metadata``; tierckpt writes it so plain DCP reads tierckpt's files
    flatten_state_dict    _nested_dict.py: a nested state dict → {dotted fqn: leaf}, mapping

and ``torch.distributed._shard`` holds ``ShardedTensor``, what FSDP1's SHARDED_STATE_DICT holds
when FSDP is built without a ``device_mesh``:

    ShardedTensor         the class, or None where this torch has none (then no state dict
                          holds one); ``is_sharded_tensor`` tests for it
    ShardedTensorBase._init_from_local_shards_and_global_metadata
                          ``sharded_like`` rebuilds a ShardedTensor around staged copies of its
                          local shards with it; without it, staging one is a TorchCompatError

Torch may move or reshape them in any release. Everything else in tierckpt imports them from
here; ``check()`` (run at import) verifies their shape and raises ``TorchCompatError`` naming
the torch version and what changed, so a changed torch fails at import with one clear message
instead of a corrupt ``.metadata`` later. ``flatten_state_dict`` has a pure-Python fallback
that follows DCP's rules (dict keys joined with ``.``, lists/tuples indexed), used only when the
private module is gone. ``_StorageInfo`` has none: a checkpoint that plain DCP reads needs
torch's own class, so its absence is an error.

``ShardedTensor`` is looked up once at import, guarded (torch deprecates the package); tierckpt
never calls a torch op on one (each would warn through its deprecated ``__torch_function__``):
it reads ``metadata()`` and ``local_shards()`` only.

``TESTED`` is the torch range these checks were written against (tests/unit/test_hardening.py
fails loudly when the installed torch is newer and a check no longer holds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from tierckpt.errors import TierckptError

__all__ = [
    "TESTED", "ShardedTensor", "StorageInfo", "TorchCompatError", "check", "flatten_state_dict", "is_sharded_tensor",
    "sharded_like",
]

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


def _load_sharded_tensor() -> tuple[type[Any] | None, Any]:
    """(ShardedTensor, the base class's constructor from local shards and global metadata), None where absent."""
    try:
        from torch.distributed._shard.sharded_tensor.api import ShardedTensor, ShardedTensorBase
    except ImportError:
        return None, None
    return ShardedTensor, getattr(ShardedTensorBase, "_init_from_local_shards_and_global_metadata", None)


if TYPE_CHECKING:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
else:
    StorageInfo = _load_storage_info()
    flatten_state_dict = _load_flatten()
ShardedTensor, _sharded_from_shards = _load_sharded_tensor()


def is_sharded_tensor(value: Any) -> bool:
    """Whether ``value`` is a ShardedTensor (check before ``torch.Tensor``: it is one, whose ops refuse most)."""
    return ShardedTensor is not None and isinstance(value, ShardedTensor)


def sharded_like(original: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """A ShardedTensor with ``original``'s global metadata (sharding spec, global size, every shard's
    offsets, sizes and placement) whose local shards are ``tensors``, one per local shard, in order.

    DCP plans it exactly as ``original`` (the same items) and reads the data from ``tensors``. As in
    torch's own constructors, the global metadata is built from ``original``'s sharding spec, global
    size and tensor properties, which is how ``original``'s was built. The base class's constructor
    checks what DCP relies on (the shards fit the global size and do not overlap); ShardedTensor's
    own also wants each shard on its placement's device and pinned as the metadata says, which a
    host copy of a CUDA shard is not. Such a copy's own shard metadata names the device it is on;
    the global metadata (what DCP writes) keeps the original placements.
    """
    if _sharded_from_shards is None:
        raise TorchCompatError(
            f"torch {torch.__version__} has no ShardedTensorBase._init_from_local_shards_and_global_metadata "
            f"(tierckpt was checked against torch {TESTED[0]}-{TESTED[1]}), so tierckpt cannot stage a "
            "ShardedTensor; build FSDP with a device_mesh (its state dict then holds DTensors)"
        )
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.shard import Shard

    shards = []
    for shard, tensor in zip(original.local_shards(), tensors, strict=True):
        md = shard.metadata
        where = md.placement
        if where is not None and where.device() != tensor.device:  # "rank:0/cuda:0" -> "rank:0/cpu"
            owner = [f"rank:{where.rank()}"] if where.rank() is not None else [where.worker_name()] if where.worker_name() else []
            md = ShardMetadata(md.shard_offsets, md.shard_sizes, "/".join([*owner, str(tensor.device)]))
        shards.append(Shard(tensor, md))
    return _sharded_from_shards(shards, original.metadata(), sharding_spec=original.sharding_spec())


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
