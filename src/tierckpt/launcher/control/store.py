"""The store primitives every part of the control plane shares: a client, a read that never blocks,
and the errors a store raises.

    client = connect_client(host, port)      # one per thread that needs the store
    peek(client, keys.verdict(epoch))        # the value, or None: one compare_set, never blocks or writes
    try: ... except store_errors(): ...      # the store's host is gone, or a call timed out
    try: client.wait(...) except timeout_error(): ...
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

__all__ = ["ABSENT", "connect_client", "hosted_here", "peek", "store_errors", "timeout_error"]

# compare_set(key, ABSENT, ABSENT) reads a key without blocking or writing: a missing key reads as
# ABSENT (the expected value does not match "missing", so nothing is set), a present one as itself
ABSENT = b"\x00absent"


def peek(store: Any, key: str) -> bytes | None:
    """``key``'s value, or None when it is not set: one store operation that never blocks (a
    ``get`` waits for a missing key) and never writes."""
    raw = bytes(store.compare_set(key, ABSENT, ABSENT))
    return None if raw == ABSENT else raw


def store_errors() -> tuple[type[BaseException], ...]:
    """What a TCPStore client raises when its server is gone or a call times out: torch's
    ``DistError`` family (``DistNetworkError``, ``DistStoreError``); ``RuntimeError`` on a torch
    without it."""
    import torch.distributed as dist

    return (dist.DistError,) if hasattr(dist, "DistError") else (RuntimeError,)


def timeout_error() -> type[BaseException]:
    """What a store's ``wait`` raises when its timeout passes."""
    import torch.distributed as dist

    return getattr(dist, "DistStoreError", RuntimeError)


def connect_client(host: str, port: int, timeout_s: float = 30.0) -> Any:
    """A new TCPStore client for ``host:port`` (one per thread that needs the store)."""
    import torch.distributed as dist

    return dist.TCPStore(  # type: ignore[attr-defined]
        host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def hosted_here(port: int) -> bool:
    """Whether this process serves the store on ``port``: one of its own sockets listens there
    (``/proc/self/net/tcp{,6}`` and ``/proc/self/fd``; False where /proc cannot tell). torch's
    handlers decide who hosts the store (``is_host``, or the endpoint's name); this asks the result."""
    listening: set[str] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                listening.add(f[9])
    if not listening:
        return False
    try:
        fds = list(Path("/proc/self/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in listening:
            return True
    return False
