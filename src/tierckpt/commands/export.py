"""``tierckpt export STEP --to DIR``: the full, consolidated model as Hugging Face safetensors.

Each tensor is assembled whole from its saved shards (any world size, any sharding), read
from the fastest tier holding a verified copy of each data file (every item's checksum is
checked before a byte is used; a bad copy falls back to the next tier). The writing is DCP's
own Hugging Face support: ``dcp.save`` with ``HuggingFaceStorageWriter`` and a name → file
mapping that keeps each file under ``--max-shard-size``. One file is ``model.safetensors``;
several are ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``, the
layout ``transformers`` and ``safetensors`` load. Non-tensor objects (step counters, learning
rates) have no place in safetensors and are listed as left out.

Limit: the exported tensors are held in memory together (DCP's writer takes one state dict),
so the machine needs RAM for the exported model.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

from tierckpt import layout
from tierckpt.commands.context import config_from, human, read_step, require_copies, step_arg, tiers_of
from tierckpt.commands.progress import Progress
from tierckpt.errors import CheckpointNotFoundError, ConfigError, IntegrityError, StorageError
from tierckpt.tiers import Tier

__all__ = ["HELP", "add_arguments", "main", "parse_size"]

HELP = "write a step's full, consolidated model as Hugging Face safetensors (with its index when sharded)"
STORAGE = True
_INDEX = "model.safetensors.index.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("step", type=step_arg, metavar="STEP", help="the step to export")
    p.add_argument("--to", required=True, metavar="DIR", help="output directory (created; must be empty)")
    p.add_argument("--format", choices=["safetensors"], default="safetensors", help="output format (safetensors)")
    p.add_argument("--prefix", metavar="KEY",
                   help="export only the tensors under KEY and drop 'KEY.' from their names (e.g. --prefix model)")
    p.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"), metavar="SIZE",
                   help="largest output file, e.g. 5GB, 500MB, 2GiB (default 5GB, as transformers)")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"size {text!r}: use a number with KB, MB, GB, KiB, MiB or GiB")
    unit = m.group(2).upper().rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    scale = base ** " KMGT".index((unit.rstrip("I") or " ")[0])
    size = int(float(m.group(1)) * scale)
    if size < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be at least one byte")
    return size


def main(args: argparse.Namespace) -> int:
    _need_safetensors()
    out = Path(args.to).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--to {out} exists and is not an empty directory; choose a new one")
    config = config_from(args)
    with tiers_of(config) as tiers:
        copies = [t for t, _ in require_copies(config, tiers, args.step)]
        manifest, metadata, source = _first_readable(copies, args.step, config.namespace)
        wanted, skipped = _select(metadata, args.prefix)
        if not wanted:
            raise CheckpointNotFoundError(f"step {args.step} has no tensors" + (f" under {args.prefix!r}" if args.prefix else ""),
                                          step=args.step)
        tensors = _assemble(copies, manifest, metadata, wanted)
    files = _write(tensors, out, args.max_shard_size)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"exported step {args.step} of {config.namespace!r} (metadata from the {source} tier): "
          f"{len(tensors)} tensor(s), {human(total)} in {sum(f.endswith('.safetensors') for f in files)} file(s) "
          f"under {out}")
    for name in files:
        print(f"  {name}")
    if skipped:
        print(f"left out (not tensors): {', '.join(skipped)}")
    return 0


def _need_safetensors() -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError as exc:
        raise ConfigError("export --format safetensors needs the safetensors package: pip install 'tierckpt[export]'") from exc


def _first_readable(copies: list[Tier], step: int, namespace: str) -> tuple[layout.Manifest, Any, str]:
    errors = []
    for tier in copies:
        try:
            manifest, metadata = read_step(tier, step, namespace)
            return manifest, metadata, tier.name
        except (IntegrityError, StorageError, CheckpointNotFoundError) as exc:
            errors.append(f"{tier.name}: {exc}")
    raise IntegrityError(f"step {step}: no copy has a readable manifest and metadata ({'; '.join(errors)})", step=step)


def _select(metadata: Any, prefix: str | None) -> tuple[dict[str, str], list[str]]:
    """Saved name → exported name for the tensors to export; the names of other objects left out."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    wanted, skipped = {}, []
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        if prefix and not fqn.startswith(prefix + "."):
            continue
        if isinstance(md, TensorStorageMetadata):
            wanted[fqn] = fqn[len(prefix) + 1 :] if prefix else fqn
        else:
            skipped.append(fqn)
    return wanted, skipped


def _assemble(copies: list[Tier], manifest: layout.Manifest, metadata: Any, wanted: dict[str, str]) -> dict[str, Any]:
    """The wanted tensors, whole, from verified data files (one file at a time, fastest tier first)."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    records = manifest.item_index()
    full: dict[str, torch.Tensor] = {}
    per_file: dict[str, list[tuple[str, Any, layout.ItemRecord]]] = {}
    for fqn in wanted:
        md = metadata.state_dict_metadata[fqn]
        full[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for i, chunk in enumerate(md.chunks):
            info = metadata.storage_data[MetadataIndex(fqn, chunk.offsets, i)]
            rec = records.get((info.relative_path, info.offset))
            if rec is None or rec.length != info.length:
                raise IntegrityError(f"{fqn}: chunk at {tuple(chunk.offsets)} is not in the manifest", step=manifest.step)
            per_file.setdefault(info.relative_path, []).append((fqn, chunk, rec))
    total = sum(t.numel() * t.element_size() for t in full.values())
    with Progress(f"export step {manifest.step}", total, unit="B") as bar:
        for name, items in sorted(per_file.items()):
            view = _verified_file(copies, manifest, name, [rec for _, _, rec in items])
            for fqn, chunk, rec in items:
                _place(full[fqn], chunk, view[rec.offset : rec.offset + rec.length], rec, fqn)
                bar.update(_nbytes(chunk.sizes, full[fqn].element_size()), fqn)
    return {wanted[fqn]: t for fqn, t in full.items()}


def _verified_file(copies: list[Tier], manifest: layout.Manifest, name: str, recs: list[layout.ItemRecord]) -> memoryview:
    from tierckpt.integrity import fetch_file, verify_items

    errors = []
    for tier in copies:
        try:
            view = fetch_file(tier, manifest.step, name, manifest.files.get(name, -1))
            verify_items(view, recs, f"{tier.location(manifest.step)}/{name}")
            return view
        except (IntegrityError, StorageError, CheckpointNotFoundError) as exc:
            errors.append(f"{tier.name}: {exc}")
    raise IntegrityError(f"step {manifest.step}: no good copy of {name} ({'; '.join(errors)})", step=manifest.step, path=name)


def _place(target: Any, chunk: Any, raw: memoryview, rec: layout.ItemRecord, fqn: str) -> None:
    import io

    import torch

    sizes = tuple(int(s) for s in chunk.sizes)
    nbytes = _nbytes(sizes, target.element_size())
    if rec.data_offset >= 0:
        if rec.data_offset + nbytes > len(raw):
            raise IntegrityError(f"{fqn}: record shorter than its tensor")
        with warnings.catch_warnings():  # read-only mapping: only read from, then copied
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            src = torch.frombuffer(raw, dtype=torch.uint8, count=nbytes, offset=rec.data_offset) if nbytes else \
                torch.empty(0, dtype=torch.uint8)
        piece = src.view(target.dtype).view(sizes)
    else:  # a record tierckpt did not write: a plain torch.save archive of the tensor
        piece = torch.load(io.BytesIO(bytes(raw)), map_location="cpu", weights_only=True)
    region = target
    for dim, (off, length) in enumerate(zip(chunk.offsets, sizes, strict=True)):
        region = region.narrow(dim, int(off), length)
    region.copy_(piece.view(sizes))


def _nbytes(sizes: Any, itemsize: int) -> int:
    n = itemsize
    for s in sizes:
        n *= int(s)
    return n


def _write(tensors: dict[str, Any], out: Path, max_shard: int) -> list[str]:
    """DCP's Hugging Face writer into a fresh directory beside ``out``, then moved into place."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    mapping, index, used = {}, 1, 0
    for name, t in tensors.items():  # in name order: neighbours (one layer's tensors) share a file
        size = t.numel() * t.element_size()
        if used and used + size > max_shard:
            index, used = index + 1, 0
        mapping[name], used = index, used + size
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        try:
            with warnings.catch_warnings():  # one process on purpose: DCP's note about it is noise here
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                save(tensors, storage_writer=HuggingFaceStorageWriter(str(tmp), fqn_to_index_mapping=mapping), no_dist=True)
        except (CheckpointException, OSError, ValueError, RuntimeError) as exc:
            raise StorageError(f"writing safetensors to {out} failed: {exc}", path=str(out)) from exc
        files = sorted(p.name for p in tmp.iterdir() if p.name.endswith(".safetensors"))
        if len(files) == 1:  # one file: the plain name, no index (what transformers writes)
            os.replace(tmp / files[0], tmp / "model.safetensors")
            (tmp / _INDEX).unlink(missing_ok=True)
            files = ["model.safetensors"]
        else:
            files.append(_INDEX)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 is for the work in progress only
        if out.exists():
            out.rmdir()  # checked empty above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files


