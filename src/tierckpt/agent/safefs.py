"""Paths under the memory root that never follow a symbolic link: every component opened with
``O_NOFOLLOW`` relative to its parent's descriptor (``openat``), so a link planted anywhere in
the root (a step directory, a file, ``.replicas/<origin>``, ``.pins``) makes the operation fail
instead of reaching outside the root. Directories the agent creates are 0700, files 0600.

Call order: ``with open_dir(root, parts, create=...) as dfd:`` → ``open_file(dfd, name, ...)`` /
``read_small(dfd, name, limit)`` / ``os.*(..., dir_fd=dfd)`` → the descriptor closes on exit.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["NotInRoot", "inside", "open_dir", "open_file", "read_small", "remove_entry"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotInRoot(OSError):
    """A path component is a link, or not what it should be: the agent does not go there."""


@contextlib.contextmanager
def open_dir(root: str | Path, parts: Sequence[str], *, create: bool = False) -> Iterator[int]:
    """A descriptor of ``root/parts...``, each component a real directory (created 0700 if asked)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            if part in ("", ".", "..") or "/" in part:
                raise NotInRoot(errno.EINVAL, f"{part!r} is not a plain name")
            if create:
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise NotInRoot(exc.errno, f"{part} under {root} is a link or not a directory") from None
                raise
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def open_file(dfd: int, name: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """``name`` in the directory ``dfd``; a link there is refused (ELOOP → NotInRoot)."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotInRoot(exc.errno, f"{name} is a symbolic link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotInRoot(errno.EINVAL, f"{name} is not a regular file")
    return fd


def read_small(dfd: int, name: str, limit: int) -> bytes:
    """The whole of a small file (at most ``limit`` bytes) in the directory ``dfd``."""
    fd = open_file(dfd, name)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise NotInRoot(errno.EFBIG, f"{name} has {size} bytes, more than {limit}")
        return os.pread(fd, size, 0) if size else b""
    finally:
        os.close(fd)


def remove_entry(dfd: int, name: str) -> None:
    """Remove ``name`` from the directory ``dfd`` without following it: a link is unlinked, a
    directory renamed aside (one step, atomic for readers) and removed without following links."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dfd)
        return
    aside = f".trash-{name}-{uuid.uuid4().hex[:8]}"
    os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
    shutil.rmtree(aside, dir_fd=dfd, ignore_errors=True)  # fd-based on Linux: links are not followed


def inside(root: str | Path, path: str | Path) -> bool:
    """Whether ``path`` resolves (links and all) to somewhere under ``root``."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return real == real_root or real.startswith(real_root.rstrip("/") + "/")
