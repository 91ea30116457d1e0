"""The node socket: ``<memory root>/.agent.sock``, where this node's agent listens for its ranks.

- ``agent_socket(memory_dir)``: the socket's path.
- ``notify_committed(memory_dir, namespace, step)``: after each memory commit, tell the agent
  (one non-blocking datagram-sized write; never waits, never raises; no agent → nothing).
- ``short_path(path)``: Unix socket paths of any length. A memory root deep in a tree (a test's
  or a job's temporary directory) puts ``<root>/.agent.sock`` beyond ``sun_path``'s 108 bytes,
  and ``bind`` and ``connect`` then fail with "AF_UNIX path too long". Call order:
  ``with short_path(path) as p: sock.bind(p)`` (or ``connect``): ``p`` is ``path`` itself when
  it fits, else ``/proc/self/fd/<fd of its directory>/<name>`` (Linux), valid inside the
  ``with`` only.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tierckpt import layout

__all__ = ["agent_socket", "notify_committed", "short_path"]

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


def agent_socket(memory_dir: str | os.PathLike[str]) -> Path:
    return Path(memory_dir) / layout.AGENT_SOCKET


def notify_committed(memory_dir: str | os.PathLike[str], namespace: str, step: int) -> bool:
    """Tell this node's agent that ``step`` of ``namespace`` is committed here; True if sent."""
    path = agent_socket(memory_dir)
    if not path.exists():
        return False
    msg = json.dumps({"op": "committed", "ns": namespace, "step": step}).encode() + b"\n"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.setblocking(False)  # a busy or wedged agent must never hold up a commit
        with short_path(path) as where:
            s.connect(where)
        return s.send(msg) == len(msg)
    except OSError:
        return False
    finally:
        s.close()
