"""``tierckpt show STEP``: what a step holds (tensors, shapes, dtypes, bytes) and where it is.

The manifest and ``.metadata`` come from the fastest tier holding a committed copy, both
checked against the commit marker; data files are not read (``verify`` does that).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from tierckpt.commands.assemble import tensor_bytes
from tierckpt.commands.context import (
    config_from,
    copies_of,
    human,
    read_first,
    require_copies,
    saved_at,
    step_arg,
    tiers_of,
)

__all__ = ["HELP", "add_arguments", "main", "describe"]

HELP = "what a step holds: tensors (name, shape, dtype, bytes), world size, tiers, when saved"
STORAGE = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("step", type=step_arg, metavar="STEP", help="the step to describe")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def main(args: argparse.Namespace) -> int:
    config = config_from(args)
    with tiers_of(config) as tiers:
        listed = copies_of(tiers, args.step, committed_only=False)  # one listing per tier
        committed = [t for t, s in listed if s.committed] or [t for t, _ in require_copies(config, tiers, args.step)]
        manifest, metadata, _ = read_first(committed, args.step, config.namespace)
        where = [{"tier": t.name, "state": "committed" if s.committed else "partial", "location": t.location(args.step),
                  "data_files": sum(1 for n in s.files if n.endswith(".distcp")), "bytes": sum(s.files.values()), "saved_at": saved_at(t, args.step)}
                 for t, s in listed]
    info = describe(metadata)
    info.update(namespace=config.namespace, step=args.step, save_id=manifest.save_id,
                world_size=manifest.world_size, copies=where)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print(info)
    return 0


def describe(metadata: Any) -> dict[str, Any]:
    """Tensors and other objects of a step from its DCP metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        stored[index.fqn] = stored.get(index.fqn, 0) + int(info.length)
    tensors, objects = [], []
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            tensors.append({"name": fqn, "shape": [int(d) for d in md.size],
                            "dtype": str(md.properties.dtype).removeprefix("torch."),
                            "bytes": tensor_bytes(md), "chunks": len(md.chunks)})
        else:
            objects.append({"name": fqn, "bytes": stored.get(fqn, 0)})
    return {"tensors": tensors, "objects": objects, "tensor_bytes": sum(t["bytes"] for t in tensors)}


def _print(info: dict[str, Any]) -> None:
    print(f"namespace {info['namespace']}  step {info['step']}  world size {info['world_size']}  save id {info['save_id']}")
    for c in info["copies"]:
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(c["saved_at"])) if c["saved_at"] else "-"
        print(f"  {c['tier']:<8} {c['state']:<10} {c['data_files']:>3} data files {human(c['bytes']):>10}  saved {when}  {c['location']}")
    tensors, objects = info["tensors"], info["objects"]
    width = max([len(t["name"]) for t in tensors + objects] + [6])
    print(f"{len(tensors)} tensor(s), {human(info['tensor_bytes'])}")
    print(f"  {'name':<{width}}  {'dtype':<10} {'shape':<18} {'bytes':>10}")
    for t in tensors:
        shape = "(" + ", ".join(map(str, t["shape"])) + ("," if len(t["shape"]) == 1 else "") + ")"
        shards = f"  ({t['chunks']} shards)" if t["chunks"] > 1 else ""
        print(f"  {t['name']:<{width}}  {t['dtype']:<10} {shape:<18} {t['bytes']:>10}{shards}")
    if objects:
        print(f"{len(objects)} other object(s) (pickled)")
        for o in objects:
            print(f"  {o['name']:<{width}}  {'object':<10} {'':<18} {o['bytes']:>10}")
