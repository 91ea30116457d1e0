"""Verifying stored copies: the seal (marker → manifest → metadata) and per-item checksums.

Data is checked item by item as it is read: ``open_reader`` opens one file of a tier for reads
into the caller's memory, and ``read_record`` / ``hash_record`` feed each record's bytes to a
running xxh3-128 as they land, so a check never costs a second pass over the source and never
holds more than one record (or one 1 MiB piece) beyond the caller's own buffers.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import xxhash

from tierckpt import layout
from tierckpt.errors import CheckpointNotFoundError, IntegrityError, StorageError
from tierckpt.tiers import Tier
from tierckpt.tiers.base import Hasher, RangeReader

__all__ = [
    "CopyReport", "MappedReader", "fetch_file", "hash_record", "new_buffer", "open_reader", "read_record", "sealed_manifest",
    "sealed_manifest_bytes", "verified_metadata", "verify_copy", "verify_items",
]

_PIECE = 1 << 20
_MAP_AT_LEAST = 1 << 20


def sealed_manifest(tier: Tier, step: int, namespace: str) -> layout.Manifest:
    """The step's manifest after checking that the marker seals it; IntegrityError if not."""
    mf_raw = tier.read_file(step, layout.MANIFEST)
    return sealed_manifest_bytes(tier.read_file(step, layout.MARKER), mf_raw, namespace, step, where=tier.location(step))


def sealed_manifest_bytes(marker_raw: bytes, mf_raw: bytes, namespace: str, step: int, *,
                          where: str, save_id: str | None = None) -> layout.Manifest:
    """``sealed_manifest`` on bytes already read (the node agent's transfers and peer cache);
    with ``save_id``, the marker and the manifest must both name that save."""
    sealed_id = layout.check_marker(marker_raw, mf_raw, where=where)
    manifest = layout.Manifest.from_bytes(mf_raw, where=f"{where}/{layout.MANIFEST}")
    if manifest.namespace != namespace or manifest.step != step:
        raise IntegrityError(f"{where}: manifest belongs to {manifest.namespace}/step_{manifest.step}", step=step)
    if save_id is not None and (sealed_id, manifest.save_id) != (save_id, save_id):
        raise IntegrityError(f"{where}: the step is save {manifest.save_id}, not {save_id}", step=step)
    return manifest


def verified_metadata(tier: Tier, manifest: layout.Manifest) -> bytes:
    """The step's ``.metadata`` bytes once they match the manifest's checksum; else IntegrityError."""
    md_raw = tier.read_file(manifest.step, layout.METADATA)
    if layout.checksum(md_raw) != manifest.metadata_xxh3:
        raise IntegrityError(f"{tier.location(manifest.step)}/.metadata fails its checksum", step=manifest.step)
    return md_raw


def fetch_file(tier: Tier, step: int, name: str, size: int) -> memoryview:
    """A whole data file: mapped when the tier is local, else read (in parallel where supported)."""
    mapper = getattr(tier, "map_file", None)
    if mapper is not None:
        view = mapper(step, name)
        if size >= 0 and len(view) != size:
            raise IntegrityError(f"{tier.location(step)}/{name} holds {len(view)} bytes, the manifest says {size}", step=step)
        return view
    return tier.read_range(step, name, 0, size)


class _ViewReader:
    """``RangeReader`` over a tier that only maps or returns ranges (the peer tier)."""

    concurrency = 4

    def __init__(self, tier: Tier, step: int, name: str) -> None:
        self.tier, self.step, self.name = tier, step, name
        self._view: memoryview | None = None

    def read_into(self, offset: int, out: memoryview, hasher: Hasher | None = None) -> None:
        mapper = getattr(self.tier, "map_file", None)
        if mapper is not None:
            if self._view is None:
                self._view = mapper(self.step, self.name)
            src = self._view[offset : offset + len(out)]
            if len(src) < len(out):
                raise StorageError(
                    f"{self.tier.location(self.step)}/{self.name} ends before byte {offset + len(out)}",
                    tier=self.tier.name, step=self.step,
                )
        else:
            src = self.tier.read_range(self.step, self.name, offset, len(out))
        for lo in range(0, len(out), _PIECE):
            out[lo : lo + _PIECE] = src[lo : lo + _PIECE]
            if hasher is not None:
                hasher.update(out[lo : lo + _PIECE])

    def read_scattered(self, offset: int, outs: list[memoryview], hasher: Hasher | None = None) -> None:
        for out in outs:
            self.read_into(offset, out, hasher)
            offset += len(out)

    def close(self) -> None:
        self._view = None


class MappedReader:
    """``RangeReader`` over bytes this process already has mapped (a slot its own save wrote).

    Each 1 MiB piece is hashed, then copied by numpy (which releases the GIL) while it is
    still in the CPU cache: one pass over the source, no kernel read path, no new mapping.
    """

    concurrency = 4

    def __init__(self, buffer: Any, where: str) -> None:
        import numpy  # optional dependency: callers fall back to reading the file without it

        self._np = numpy
        self.src = buffer  # a uint8 numpy array over the mapping
        self.where = where

    def read_into(self, offset: int, out: memoryview, hasher: Hasher | None = None) -> None:
        if offset + len(out) > len(self.src):
            raise StorageError(f"{self.where} ends before byte {offset + len(out)}")
        dst = self._np.frombuffer(out, dtype=self._np.uint8)
        for lo in range(0, len(out), _PIECE):
            piece = self.src[offset + lo : offset + min(len(out), lo + _PIECE)]
            if hasher is not None:
                hasher.update(piece)
            dst[lo : lo + len(piece)] = piece

    def read_scattered(self, offset: int, outs: list[memoryview], hasher: Hasher | None = None) -> None:
        for out in outs:
            self.read_into(offset, out, hasher)
            offset += len(out)

    def close(self) -> None:
        self.src = None


def open_reader(tier: Tier, step: int, name: str) -> RangeReader:
    """One data file of ``tier`` open for ``read_into`` (reads straight into the caller's memory)."""
    opener = getattr(tier, "open_reader", None)
    if opener is not None:
        reader: RangeReader = opener(step, name)
        return reader
    return _ViewReader(tier, step, name)


def new_buffer(size: int) -> memoryview:
    """A writable scratch buffer; fresh anonymous pages when large (no zero-filling pass up front)."""
    if size < _MAP_AT_LEAST:
        return memoryview(bytearray(size))
    # private: counted as the process's own (anonymous) memory, and freed when the view goes
    return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


def read_record(reader: RangeReader, rec: layout.ItemRecord, where: str, data: memoryview | None = None) -> memoryview | None:
    """Read one record, checking its xxh3 as the bytes land; IntegrityError on a mismatch.

    With ``data`` (the raw tensor bytes' destination, e.g. a target tensor's memory) the
    record's data goes there and only its few header/trailer bytes into scratch; None is
    returned. Without, the whole record is read into a new buffer, which is returned.
    """
    hasher = xxhash.xxh3_128()
    if data is None:
        out = new_buffer(rec.length)
        reader.read_into(rec.offset, out, hasher)
    else:
        head, tail = rec.data_offset, rec.length - rec.data_offset - len(data)
        if head < 0 or tail < 0:
            raise IntegrityError(f"{where}: item at offset {rec.offset} is shorter than its tensor")
        reader.read_scattered(rec.offset, [memoryview(bytearray(head)), data, memoryview(bytearray(tail))], hasher)
        out = None
    if hasher.hexdigest() != rec.xxh3:
        raise IntegrityError(f"{where}: item at offset {rec.offset} ({rec.length} bytes) fails its checksum")
    return out


def hash_record(reader: RangeReader, rec: layout.ItemRecord, where: str, scratch: memoryview) -> None:
    """Check one record's xxh3 reading it through ``scratch`` piece by piece (nothing kept)."""
    hasher = xxhash.xxh3_128()
    for lo in range(0, rec.length, len(scratch)):
        piece = scratch[: min(len(scratch), rec.length - lo)]
        reader.read_into(rec.offset + lo, piece, hasher)
    if hasher.hexdigest() != rec.xxh3:
        raise IntegrityError(f"{where}: item at offset {rec.offset} ({rec.length} bytes) fails its checksum")


def verify_items(
    view: memoryview, records: list[layout.ItemRecord], where: str, map_fn: Callable[..., Iterable[str]] = map
) -> None:
    """Check each record's xxh3 over ``view``; ``map_fn`` may be a thread pool's map."""
    digests = map_fn(lambda r: layout.checksum(view[r.offset : r.offset + r.length]), records)
    for r, digest in zip(records, digests, strict=True):
        if digest != r.xxh3:
            raise IntegrityError(f"{where}: item at offset {r.offset} ({r.length} bytes) fails its checksum")


@dataclass
class CopyReport:
    """What ``verify_copy`` found for one step in one tier."""

    tier: str
    location: str
    ok: bool
    files_checked: list[str] = field(default_factory=list)
    files_missing: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def verify_copy(tier: Tier, step: int, namespace: str, *, require_all_files: bool = True) -> CopyReport:
    """Check one tier's copy of a step completely: seal, metadata, every item of every file."""
    report = CopyReport(tier.name, tier.location(step), ok=False)
    try:
        manifest = sealed_manifest(tier, step, namespace)
        verified_metadata(tier, manifest)
        scratch = new_buffer(8 * _PIECE)
        for name in sorted(manifest.files):
            try:
                reader = open_reader(tier, step, name)
                try:  # item by item through one scratch buffer: memory stays flat however big the file
                    for rec in (r for r in manifest.items if r.file == name):
                        hash_record(reader, rec, f"{tier.location(step)}/{name}", scratch)
                finally:
                    reader.close()
            except CheckpointNotFoundError:
                report.files_missing.append(name)
                continue
            report.files_checked.append(name)
        if report.files_missing and require_all_files:
            report.problems.append("missing files: " + ", ".join(report.files_missing))
    except (IntegrityError, StorageError, CheckpointNotFoundError) as exc:
        report.problems.append(str(exc))
    report.ok = not report.problems
    return report
