"""Whole tensors out of a committed step, one verified record at a time, for ``tierckpt export``.

Each saved chunk is a record in a rank's data file; the manifest holds its checksum. A record
is read from the fastest tier holding the file (a local tier maps the file once; S3 fetches
just the record's byte range), checked, and copied into place in the whole tensor; a copy
that fails (missing file, bad checksum, I/O error) is skipped for the rest of the export and
the next tier is tried. Call order: ``TensorAssembler(copies, manifest, metadata)`` →
``tensor(fqn)`` any number of times → ``close()``.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import torch

from tierckpt import layout
from tierckpt.errors import CheckpointNotFoundError, IntegrityError, StorageError
from tierckpt.tiers import Tier

__all__ = ["TensorAssembler", "tensor_bytes"]


def tensor_bytes(md: Any) -> int:
    """Bytes of the whole tensor a ``TensorStorageMetadata`` describes."""
    n = md.properties.dtype.itemsize
    for s in md.size:
        n *= int(s)
    return n


class TensorAssembler:
    """Reads whole tensors of one step from ``copies`` (fastest tier first)."""

    def __init__(self, copies: list[Tier], manifest: layout.Manifest, metadata: Any) -> None:
        self.copies = copies
        self.manifest = manifest
        self.metadata = metadata
        self.records = manifest.item_index()
        self._maps: dict[tuple[str, str], memoryview] = {}
        self._bad: dict[tuple[str, str], str] = {}  # (tier, file) → why it is skipped

    def close(self) -> None:
        self._maps.clear()  # the mappings go with their last view

    def tensor(self, fqn: str) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        md = self.metadata.state_dict_metadata[fqn]
        full = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for i, chunk in enumerate(md.chunks):
            info = self.metadata.storage_data[MetadataIndex(fqn, chunk.offsets, i)]
            rec = self.records.get((info.relative_path, info.offset))
            if rec is None or rec.length != info.length:
                raise IntegrityError(f"{fqn}: chunk at {tuple(chunk.offsets)} is not in the manifest", step=self.manifest.step)
            region = full
            for dim, (off, length) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                region = region.narrow(dim, int(off), int(length))
            region.copy_(_decode(self._record(info.relative_path, rec), rec, full.dtype, tuple(region.shape), fqn))
        return full

    def _record(self, name: str, rec: layout.ItemRecord) -> memoryview:
        step = self.manifest.step
        for tier in self.copies:
            if (tier.name, name) in self._bad:
                continue
            try:
                raw = self._read(tier, name, rec)
                if layout.checksum(raw) != rec.xxh3:
                    raise IntegrityError(f"{tier.location(step)}/{name}: item at offset {rec.offset} fails its checksum")
                return raw
            except (IntegrityError, StorageError, CheckpointNotFoundError) as exc:
                self._bad[(tier.name, name)] = f"{tier.name}: {exc}"
        reasons = "; ".join(why for (_, f), why in self._bad.items() if f == name)
        raise IntegrityError(f"step {step}: no good copy of {name} ({reasons or 'no tier holds it'})", step=step, path=name)

    def _read(self, tier: Tier, name: str, rec: layout.ItemRecord) -> memoryview:
        mapper = getattr(tier, "map_file", None)
        if mapper is None:  # remote: fetch only this record's bytes
            return tier.read_range(self.manifest.step, name, rec.offset, rec.length)
        key = (tier.name, name)
        if key not in self._maps:
            view = mapper(self.manifest.step, name)
            expected = self.manifest.files.get(name, -1)
            if expected >= 0 and len(view) != expected:
                raise IntegrityError(f"{tier.location(self.manifest.step)}/{name} holds {len(view)} bytes, "
                                     f"the manifest says {expected}")
            self._maps[key] = view
        return self._maps[key][rec.offset : rec.offset + rec.length]


def _decode(raw: memoryview, rec: layout.ItemRecord, dtype: torch.dtype, shape: tuple[int, ...], fqn: str) -> torch.Tensor:
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    if rec.data_offset < 0:  # a record tierckpt did not write: a plain torch.save archive
        return torch.load(io.BytesIO(bytes(raw)), map_location="cpu", weights_only=True).view(shape)
    if rec.data_offset + nbytes > len(raw):
        raise IntegrityError(f"{fqn}: record shorter than its tensor")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # a read-only mapping: only read from, then copied
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        src = torch.frombuffer(raw, dtype=torch.uint8, count=nbytes, offset=rec.data_offset)
    return src.view(dtype).view(shape)
