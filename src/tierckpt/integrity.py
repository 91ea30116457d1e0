"""Verifying stored copies: the seal (marker → manifest → metadata) and per-item checksums."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tierckpt import layout
from tierckpt.errors import CheckpointNotFoundError, IntegrityError, StorageError
from tierckpt.tiers import Tier

__all__ = ["CopyReport", "fetch_file", "sealed_manifest", "verified_metadata", "verify_copy", "verify_items"]


def sealed_manifest(tier: Tier, step: int, namespace: str) -> layout.Manifest:
    """The step's manifest after checking that the marker seals it; IntegrityError if not."""
    where = tier.location(step)
    mf_raw = tier.read_file(step, layout.MANIFEST)
    layout.check_marker(tier.read_file(step, layout.MARKER), mf_raw, where=where)
    manifest = layout.Manifest.from_bytes(mf_raw, where=f"{where}/{layout.MANIFEST}")
    if manifest.namespace != namespace or manifest.step != step:
        raise IntegrityError(f"{where}: manifest belongs to {manifest.namespace}/step_{manifest.step}", step=step)
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
        for name, size in sorted(manifest.files.items()):
            try:
                view = fetch_file(tier, step, name, size)
            except CheckpointNotFoundError:
                report.files_missing.append(name)
                continue
            verify_items(view, [r for r in manifest.items if r.file == name], f"{tier.location(step)}/{name}")
            report.files_checked.append(name)
        if report.files_missing and require_all_files:
            report.problems.append("missing files: " + ", ".join(report.files_missing))
    except (IntegrityError, StorageError, CheckpointNotFoundError) as exc:
        report.problems.append(str(exc))
    report.ok = not report.problems
    return report
