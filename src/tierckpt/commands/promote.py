"""``tierckpt promote STEP``: copy a step from the memory tier to the durable tier now.

The copy is the library's own (``tiers/copy.py``): each data file is pinned (retention cannot
recycle its shared-memory slot meanwhile) and checked against the manifest first, so a corrupt
memory copy is never made durable; then ``Tier.put_file`` per file (sendfile on a filesystem,
parallel multipart upload on S3), then ``Tier.commit`` (the small files, the marker last),
then the durable copy is verified end to end. A step the durable tier holds already is left
as it is. Only the files this node's memory tier holds can be copied: with several nodes,
every file must be here (``tierckpt agent flush`` drains from each node instead).
"""

from __future__ import annotations

import argparse

from tierckpt.commands.context import config_from, human, step_arg, tiers_of
from tierckpt.commands.progress import Progress
from tierckpt.errors import CheckpointNotFoundError, ConfigError
from tierckpt.tiers import LocalTier, Tier
from tierckpt.tiers.copy import check_files, commit_step, pin_files, put_files, sealed_step, verify_step

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
    sealed = sealed_step(memory, step, namespace)
    manifest = sealed.manifest
    held = {s.step: s.files for s in memory.list_steps()}.get(step, {})
    missing = sorted(n for n in manifest.files if n not in held)
    if missing:
        raise CheckpointNotFoundError(
            f"step {step}: this node's memory tier lacks {', '.join(missing)} (other nodes' ranks); "
            "promote needs every file on one node: run `tierckpt agent flush` on each node instead", step=step)
    total = sum(manifest.files.values())
    pins = pin_files(memory, step, sorted(manifest.files))
    check_files(pins, manifest, memory.location(step))  # every pinned file before a byte is made durable
    try:
        with Progress(f"promote step {step}", total, unit="B") as bar:
            put_files(durable, step, manifest.save_id, pins, done=bar.update)
            commit_step(durable, step, manifest.save_id, sealed.metadata, sealed.manifest_raw)
    except BaseException:
        abort = getattr(durable, "abort", None)  # a directory tier drops its staging; S3 leftovers are gc's
        if abort is not None:
            abort(step, manifest.save_id)
        raise
    verify_step(durable, step, namespace)
    return total
