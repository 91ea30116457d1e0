"""Unix socket paths of any length: a memory root deep in a tree (a test's or a job's temporary
directory) puts ``<root>/.agent.sock`` beyond ``sun_path``'s 108 bytes, and ``bind`` and
``connect`` then fail with "AF_UNIX path too long".

Call order: ``with short_path(path) as p: sock.bind(p)`` (or ``connect``): ``p`` is ``path``
itself when it fits, else ``/proc/self/fd/<fd of its directory>/<name>`` (Linux), valid inside
the ``with`` only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["short_path"]

_FITS = 100  # bytes; sun_path holds 108 with its terminating NUL, a margin for the kernel's checks


@contextmanager
def short_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """A name for the socket at ``path`` short enough for ``bind`` and ``connect``."""
    full = os.fspath(path)
    if len(os.fsencode(full)) <= _FITS:
        yield full
        return
    fd = os.open(os.path.dirname(full) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{os.path.basename(full)}"
    finally:
        os.close(fd)
