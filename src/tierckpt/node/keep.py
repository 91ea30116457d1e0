"""Steps of a memory namespace that retention and budget eviction must not delete.

The node agent writes ``<memory root>/<namespace>/.keep`` (a JSON list of steps, 0600,
replaced with one rename): the steps of this node's own namespace that a replica it holds
for another node is at, and the newest own step it replicated to peers. Were retention to
delete them, a lost node's replica would match no step the surviving ranks still hold.

Call order: the agent calls ``write_protected(dfd, steps)`` (``dfd``: the namespace directory) whenever what it holds changes;
each save's ``RankRuntime.apply_retention`` / ``evict_for_room`` call ``read_protected(ns_dir)``
and pass the steps to ``RetentionPolicy``. A missing or unreadable file protects nothing.
Budget eviction takes a protected step only when nothing else can go (a save would fail).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable
from pathlib import Path

__all__ = ["KEEP_FILE", "read_protected", "write_protected"]

KEEP_FILE = ".keep"
_MAX_BYTES = 1 << 16


def read_protected(ns_dir: Path) -> frozenset[int]:
    """The steps listed in ``ns_dir/.keep`` (empty when there is none, or it is not a list of steps)."""
    try:
        fd = os.open(ns_dir / KEEP_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return frozenset()
    try:
        raw = os.read(fd, _MAX_BYTES)
    except OSError:
        return frozenset()
    finally:
        os.close(fd)
    try:
        steps = json.loads(raw)
    except ValueError:
        return frozenset()
    if not isinstance(steps, list):
        return frozenset()
    return frozenset(s for s in steps if isinstance(s, int) and not isinstance(s, bool) and s >= 0)


def write_protected(dfd: int, steps: Iterable[int]) -> None:
    """Replace ``.keep`` in the namespace directory open as ``dfd`` (a temporary file, one rename)."""
    tmp = f".{KEEP_FILE}.{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        os.write(fd, json.dumps(sorted(set(steps))).encode())
    finally:
        os.close(fd)
    try:
        os.rename(tmp, KEEP_FILE, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError:
        os.unlink(tmp, dir_fd=dfd)
        raise
