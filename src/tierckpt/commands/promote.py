"""``tierckpt promote STEP``: copy a step from the memory tier to the durable tier now.

The copy is the library's own drain: each data file is pinned (retention cannot recycle its
shared-memory slot meanwhile) and checked against the manifest first, so a corrupt memory
copy is never made durable; then ``Tier.put_file`` per file (sendfile on a filesystem,
parallel multipart upload on S3), then ``Tier.commit`` (the small files, the marker last),
then the durable copy is verified end to end. A step the durable tier holds already is left
as it is. Only the files this node's memory tier holds can be copied: with several nodes,
every file must be here (``tierckpt agent flush`` drains from each node instead).
"""

from __future__ import annotations

import argparse
import mmap
from pathlib import Path

from tierckpt import layout
from tierckpt.commands.context import config_from, human, step_arg, tiers_of
from tierckpt.commands.progress import Progress
from tierckpt.errors import CheckpointNotFoundError, ConfigError, IntegrityError
from tierckpt.tiers import LocalTier, Tier

__all__ = ["HELP", "add_arguments", "main"]

HELP = "copy a memory step to the durable tier now (file:// or s3://; verified, marker last)"
STORAGE = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("step", type=step_arg, metavar="STEP", help="a committed step in this node's memory tier")


def main(args: argparse.Namespace) -> int:
    config = config_from(args)
    if config.durable_url is None:
        raise ConfigError("promote needs a durable tier: pass --durable-url file:///path or s3://bucket/prefix "
                          "(or set TIERCKPT_DURABLE_URL)")
    with tiers_of(config) as tiers:
        memory, durable = tiers[0], tiers[1]
        if any(s.step == args.step for s in durable.list_steps()):
            print(f"step {args.step} is durable already: {durable.location(args.step)}")
            return 0
        if not isinstance(memory, LocalTier) or not any(s.step == args.step for s in memory.list_steps()):
            held = ", ".join(str(s.step) for s in memory.list_steps()) or "none"
            raise CheckpointNotFoundError(f"step {args.step} of {config.namespace!r} is not committed in the memory tier "
                                          f"{memory.location()} (committed there: {held})", step=args.step)
        nbytes = promote(memory, durable, args.step, config.namespace)
    print(f"step {args.step} promoted: {human(nbytes)} verified at {durable.location(args.step)}")
    return 0


def promote(memory: LocalTier, durable: Tier, step: int, namespace: str) -> int:
    """Copy ``step`` from ``memory`` to ``durable``, commit it, verify it; return the bytes copied."""
    from tierckpt.integrity import sealed_manifest, verified_metadata, verify_copy, verify_items

    manifest = sealed_manifest(memory, step, namespace)
    md_raw = verified_metadata(memory, manifest)
    mf_raw = memory.read_file(step, layout.MANIFEST)
    held = {s.step: s.files for s in memory.list_steps()}.get(step, {})
    missing = sorted(n for n in manifest.files if n not in held)
    if missing:
        raise CheckpointNotFoundError(
            f"step {step}: this node's memory tier lacks {', '.join(missing)} (other nodes' ranks); "
            "promote needs every file on one node: run `tierckpt agent flush` on each node instead", step=step)
    total = sum(manifest.files.values())
    pins: dict[str, Path] = {}
    try:
        for name in sorted(manifest.files):
            pin = memory.pin(step, name)
            if pin is None:
                raise CheckpointNotFoundError(f"{name} of step {step} left the memory tier during the copy "
                                              "(retention removed the step); promote a newer step", step=step)
            pins[name] = pin
        # the pins are the step's own files: check every one before a byte is made durable
        for name, pin in pins.items():
            verify_items(_map(pin), [r for r in manifest.items if r.file == name], f"{memory.location(step)}/{name}")
        _copy(durable, step, manifest.save_id, pins, {layout.METADATA: md_raw, layout.MANIFEST: mf_raw}, total)
    finally:
        for pin in pins.values():
            memory.unpin(pin)
    report = verify_copy(durable, step, namespace)
    if not report.ok:
        raise IntegrityError(f"step {step}: the durable copy at {report.location} fails verification after the copy: "
                             + "; ".join(report.problems) + "; delete it and promote again", step=step)
    return total




def _copy(durable: Tier, step: int, save_id: str, pins: dict[str, Path], small: dict[str, bytes], total: int) -> None:
    """The drain's two calls: ``put_file`` per data file, then ``commit`` (the marker last)."""
    try:
        with Progress(f"promote step {step}", total, unit="B") as bar:
            for name, pin in pins.items():
                durable.put_file(step, save_id, name, pin)
                bar.update(pin.stat().st_size, name)
            durable.commit(step, save_id, small)
    except BaseException:
        abort = getattr(durable, "abort", None)  # a directory tier drops its staging; S3 leftovers are gc's
        if abort is not None:
            abort(step, save_id)
        raise


def _map(path: Path) -> memoryview:
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        return memoryview(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)) if size else memoryview(b"")
