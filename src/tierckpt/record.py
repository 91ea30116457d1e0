"""Byte formats inside a step: tensor records and the pickled DCP metadata.

A tensor record is a complete ``torch.save`` archive of one contiguous tensor, so plain
``FileSystemReader`` (which ``torch.load``s each item) reads tierckpt's files unchanged.
The archive's header and trailer depend only on dtype and shape: torch's own writer
produces them once (``torch.serialization.skip_data``) and tierckpt caches them, so a save
writes the raw tensor bytes into the hole between them and never pickles a tensor.
``torch.load`` does not check the zip CRC, so the stale CRC field is harmless; integrity
comes from tierckpt's own xxh3 checksums instead.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import IO, Any, cast

import torch

from tierckpt.errors import IntegrityError, TierckptError

__all__ = ["TensorRecord", "dumps_metadata", "loads_metadata", "tensor_record"]

ALIGN = 64


@dataclass(frozen=True)
class TensorRecord:
    """One tensor's archive layout: ``prefix`` + raw bytes + ``suffix``."""

    prefix: bytes
    nbytes: int
    suffix: bytes

    @property
    def length(self) -> int:
        return len(self.prefix) + self.nbytes + len(self.suffix)

    @property
    def data_offset(self) -> int:
        return len(self.prefix)


class _SparseSink(io.RawIOBase):
    """A write-only file that keeps small writes and lets torch seek over the data hole."""

    def __init__(self) -> None:
        self.pos = 0
        self.end = 0
        self.chunks: list[tuple[int, bytes]] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        self.chunks.append((self.pos, data))
        self.pos += len(data)
        self.end = max(self.end, self.pos)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.end}[whence]
        self.pos = base + offset
        self.end = max(self.end, self.pos)
        return self.pos

    def tell(self) -> int:
        return self.pos


def tensor_record(dtype: torch.dtype, shape: tuple[int, ...]) -> TensorRecord:
    """Build the archive layout for a contiguous CPU tensor of ``dtype`` and ``shape``.

    Costs one untouched allocation of the tensor's size (no page is written) and a few
    hundred microseconds; callers cache the result per (dtype, shape).
    """
    template = torch.empty(shape, dtype=dtype)
    nbytes = template.numel() * template.element_size()
    sink = _SparseSink()
    with torch.serialization.skip_data():
        torch.save(template, cast(IO[bytes], sink))
    del template
    image = bytearray(sink.end)
    gaps, covered = [], 0
    for pos, data in sorted(sink.chunks):
        if pos > covered:
            gaps.append((covered, pos - covered))
        image[pos : pos + len(data)] = data
        covered = max(covered, pos + len(data))
    if nbytes == 0:
        return TensorRecord(bytes(image), 0, b"")
    if len(gaps) != 1 or gaps[0][1] != nbytes or gaps[0][0] % ALIGN:
        raise TierckptError(
            f"torch {torch.__version__} lays out torch.save archives in a way tierckpt does not know "
            f"({dtype} {shape}: data holes {gaps}); use a torch version tierckpt supports (see pyproject.toml)"
        )
    hole = gaps[0][0]
    return TensorRecord(bytes(image[:hole]), nbytes, bytes(image[hole + nbytes :]))


_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.serialization": {"_get_layout"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size", "device"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "getattr"},
    "torch._utils": {"_rebuild_tensor_v2"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only DCP metadata classes and torch's dtype/layout/format singletons."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise IntegrityError(f"checkpoint metadata references {module}.{name}, which is not allowed")


def dumps_metadata(metadata: Any) -> bytes:
    return pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)


def loads_metadata(raw: bytes, *, where: str = ".metadata") -> Any:
    """Unpickle DCP ``Metadata`` with a restricted unpickler; bad input → IntegrityError."""
    try:
        return _MetadataUnpickler(io.BytesIO(raw)).load()
    except IntegrityError:
        raise
    except Exception as exc:  # any unpickling failure means the copy is unusable
        raise IntegrityError(f"{where} cannot be read: {exc}") from exc
