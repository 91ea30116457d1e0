"""``tierckpt gc``: find, and with ``--yes`` delete, what dead or interrupted saves left behind.

Dry run by default. What it finds, per tier of the namespace:
  torn step        ``step_N/`` without its marker (a deletion that died half-way; a local
                   commit is a rename, so it never leaves one)
  marker-less step on S3: a step's objects without a marker, none newer than ``--min-age``
                   (an upload that died; a younger one may be a save in progress)
  aborted upload   an S3 multipart upload under the namespace started before ``--min-age``
  dead staging     ``.staging/step_N.<id>/`` whose writers on this host are all dead
  dead pin         ``.pins/`` links of dead processes (they keep a slot busy)
  orphan slot      a shared-memory slot no step and no pin links, mapped by no process on
                   this host, untouched for ``--min-age``
  trash            what an interrupted deletion left in ``.trash/``
Never touched: a committed step (a step directory holding its marker, an S3 step with its
marker), a staging directory of a live process or of another host, a slot a process maps.
Deleting a torn step renames it away first and checks again that it has no marker.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from tierckpt import layout
from tierckpt.commands.context import config_from, human, tiers_of
from tierckpt.commands.progress import Progress
from tierckpt.tiers import LocalTier, Tier
from tierckpt.tiers.local import _owner_alive

__all__ = ["HELP", "Finding", "add_arguments", "find", "main"]

HELP = "delete what dead saves left: torn steps, aborted S3 uploads, dead staging, orphan slots (dry run unless --yes)"
STORAGE = True


@dataclass(frozen=True)
class Finding:
    """One thing gc found: removed with ``--yes`` unless ``keep`` says why not."""

    tier: str
    kind: str
    location: str
    nbytes: int
    remove: Callable[[], None] | None = None
    keep: str = ""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--yes", action="store_true", help="delete what was found (default: only list it)")
    p.add_argument("--min-age", type=float, default=900.0, metavar="SECONDS",
                   help="leave S3 leftovers, owner-less staging and free slots younger than this (default 900): "
                        "they may belong to a save in progress")


def main(args: argparse.Namespace) -> int:
    config = config_from(args)
    with tiers_of(config) as tiers:
        found = [f for tier in tiers for f in find(tier, min_age=args.min_age)]
        doomed = [f for f in found if not f.keep]
        for f in found:
            action = ("delete" if args.yes else "would delete") if not f.keep else "keep"
            reason = f"  ({f.keep})" if f.keep else ""
            print(f"{action:<12} {f.tier:<8} {f.kind:<17} {human(f.nbytes):>10}  {f.location}{reason}")
        if not doomed:
            print(f"nothing to delete in namespace {config.namespace!r}")
            return 0
        if not args.yes:
            print(f"dry run: {len(doomed)} item(s), {human(sum(f.nbytes for f in doomed))}; run again with --yes to delete")
            return 0
        with Progress("gc", len(doomed)) as bar:
            for f in doomed:
                if f.remove is not None:
                    f.remove()
                bar.update(1, f.location)
    print(f"deleted {len(doomed)} item(s), {human(sum(f.nbytes for f in doomed))}")
    return 0


def find(tier: Tier, *, min_age: float) -> list[Finding]:
    """What ``tier`` holds that gc would delete (or deliberately keeps), without changing anything."""
    if isinstance(tier, LocalTier):
        return _find_local(tier, min_age)
    if hasattr(tier, "client") and hasattr(tier, "ns_key"):
        return _find_s3(tier, min_age)
    return []


# -- a directory tier (memory or file://) ---------------------------------------------------
def _find_local(tier: LocalTier, min_age: float) -> list[Finding]:
    out: list[Finding] = []
    now = time.time()
    for entry in _scan(tier.ns_dir):
        if layout.parse_step_dir(entry.name) is not None and not os.path.exists(os.path.join(entry.path, layout.MARKER)):
            out.append(Finding(tier.name, "torn step", entry.path, _du(entry.path),
                               remove=partial(tier._to_trash, Path(entry.path), unless_committed=True)))
    for entry in _scan(tier.ns_dir / layout.STAGING):
        owners = [p.name for p in Path(entry.path).glob(".owner-*")]
        live = [o for o in owners if _owner_alive(o)]
        keep = ""
        if live:
            keep = "in use by " + ", ".join(o.removeprefix(".owner-") for o in live)
        elif not owners and now - _mtime(entry.path) < min_age:
            keep = "a commit may be in progress: younger than --min-age"
        out.append(Finding(tier.name, "dead staging", entry.path, _du(entry.path),
                           remove=partial(shutil.rmtree, entry.path, ignore_errors=True), keep=keep))
    for entry in _scan(tier.ns_dir / layout.PINS):
        owner = ".owner-" + entry.name.split(".owner-", 1)[-1].rsplit(".", 1)[0]
        if not _owner_alive(owner):
            out.append(Finding(tier.name, "dead pin", entry.path, 0,
                               remove=partial(_remove_path, entry.path)))
    for entry in _scan(tier.ns_dir / layout.TRASH):
        out.append(Finding(tier.name, "trash", entry.path, _du(entry.path),
                           remove=partial(_remove_path, entry.path)))
    out.extend(_find_slots(tier, min_age))
    return out


def _find_slots(tier: LocalTier, min_age: float) -> list[Finding]:
    slots = [e for d in _scan(tier.ns_dir / layout.SLOTS) if d.is_dir() for e in _scan(Path(d.path))
             if e.name.startswith("slot_")]
    if not slots:
        return []
    mapped = _mapped_inodes()
    out, now = [], time.time()
    for e in slots:
        st = e.stat()
        if st.st_nlink > 1:
            continue  # a committed step or a pin links it: it is the memory tier itself
        keep = ""
        if st.st_ino in mapped:
            keep = "mapped by a running process"
        elif now - max(st.st_mtime, st.st_ctime) < min_age:
            keep = "younger than --min-age"
        out.append(Finding(tier.name, "orphan slot", e.path, st.st_size,
                           remove=partial(_remove_path, e.path), keep=keep))
    return out


def _mapped_inodes() -> set[int]:
    """Inodes of files any process on this host (that we may inspect) has mapped."""
    out: set[int] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    if len(fields) >= 5 and fields[4] != "0":
                        out.add(int(fields[4]))
        except OSError:  # gone, or another user's: its slots are not ours to judge
            continue
    return out


def _remove_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        Path(path).unlink(missing_ok=True)


def _scan(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return time.time()


# -- S3 ----------------------------------------------------------------------------------
def _find_s3(tier: Any, min_age: float) -> list[Finding]:
    now = time.time()
    steps: dict[int, list[tuple[str, int, float]]] = {}
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {"Bucket": tier.bucket, "Prefix": tier.ns_key}
        if token:
            kwargs["ContinuationToken"] = token
        page = tier.retrier.call(partial(tier.client.list_objects_v2, **kwargs), what="listing", key=tier.ns_key)
        for obj in page.get("Contents", ()):
            dirname, sep, fname = str(obj["Key"])[len(tier.ns_key) :].partition("/")
            step = layout.parse_step_dir(dirname)
            if step is not None and sep and fname:
                steps.setdefault(step, []).append((fname, int(obj["Size"]), obj["LastModified"].timestamp()))
        token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
        if not token:
            break
    out: list[Finding] = []
    for step, objs in sorted(steps.items()):
        if any(name == layout.MARKER for name, _, _ in objs):
            continue  # committed: never gc's
        young = now - max(t for _, _, t in objs) < min_age
        out.append(Finding(tier.name, "marker-less step", tier.location(step), sum(n for _, n, _ in objs),
                           remove=partial(_remove_s3_step, tier, step, [n for n, _, _ in objs]),
                           keep="younger than --min-age: a save may be uploading" if young else ""))
    page = tier.retrier.call(lambda: tier.client.list_multipart_uploads(Bucket=tier.bucket, Prefix=tier.ns_key),
                             what="listing uploads", key=tier.ns_key)
    for up in page.get("Uploads", ()):
        young = now - up["Initiated"].timestamp() < min_age
        out.append(Finding(tier.name, "aborted upload", f"s3://{tier.bucket}/{up['Key']}", _parts_size(tier, up),
                           remove=partial(_abort_upload, tier, up["Key"], up["UploadId"]),
                           keep="younger than --min-age: it may still be uploading" if young else ""))
    return out


def _parts_size(tier: Any, upload: dict[str, Any]) -> int:
    """Bytes the upload's parts hold (its first 1000 parts: a label, not an account)."""
    reply = tier.retrier.call(partial(tier.client.list_parts, Bucket=tier.bucket, Key=upload["Key"],
                                      UploadId=upload["UploadId"]), what="listing parts", key=upload["Key"])
    return sum(int(p.get("Size", 0)) for p in reply.get("Parts", ()))


def _abort_upload(tier: Any, key: str, upload_id: str) -> None:
    tier.retrier.call(partial(tier.client.abort_multipart_upload, Bucket=tier.bucket, Key=key, UploadId=upload_id),
                      what="abort upload", key=key)


def _remove_s3_step(tier: Any, step: int, names: list[str]) -> None:
    listed = [s for s in tier.list_steps(include_uncommitted=True) if s.step == step]
    if any(layout.MARKER in s.files for s in listed):
        return  # committed since the scan: not gc's any more
    tier._delete_keys([tier.key(step, n) for n in names])
