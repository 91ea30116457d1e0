"""The store primitives every part of the control plane shares: a client, a read that never blocks,
and the errors a store raises.

    client = connect_client(host, port)      # one per thread that needs the store
    peek(client, keys.verdict(epoch))        # the value, or None: one compare_set, never blocks or writes
    try: ... except store_errors(): ...      # the store's host is gone, or a call timed out
    try: client.wait(...) except timeout_error(): ...
    wait_parts(client, names, 10.0); multi_get_parts(client, names)   # thousands of keys
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["ABSENT", "KEYS_PER_CALL", "connect_client", "hosted_here", "multi_get_parts", "peek", "store_errors",
           "timeout_error", "wait_parts"]

# compare_set(key, ABSENT, ABSENT) reads a key without blocking or writing: a missing key reads as
# ABSENT (the expected value does not match "missing", so nothing is set), a present one as itself
ABSENT = b"\x00absent"
#: keys per ``wait`` or ``multi_get`` call when one reads a key per node: one call of thousands of
#: keys costs more than its 512-key parts on torch's libuv server (a multi_get of 8192 keys took
#: 145 ms here, 16 of 512 took 44 ms; a wait on 4096 present keys 12 ms, 8 of 512 about 5 ms;
#: bench rdzv's "alone" phase). Up to 512 keys it is one call, as before.
KEYS_PER_CALL = 512


def peek(store: Any, key: str) -> bytes | None:
    """``key``'s value, or None when it is not set: one store operation that never blocks (a
    ``get`` waits for a missing key) and never writes."""
    raw = bytes(store.compare_set(key, ABSENT, ABSENT))
    return None if raw == ABSENT else raw


def wait_parts(store: Any, names: list[str], timeout_s: float) -> None:
    """``store.wait(names)`` in calls of ``KEYS_PER_CALL`` keys under one deadline of ``timeout_s``;
    raises ``timeout_error()`` as ``wait`` does."""
    deadline = time.monotonic() + timeout_s
    for at in range(0, len(names), KEYS_PER_CALL):
        left = max(deadline - time.monotonic(), 0.001)
        store.wait(names[at : at + KEYS_PER_CALL], datetime.timedelta(seconds=left))


def multi_get_parts(store: Any, names: list[str]) -> list[bytes]:
    """``store.multi_get(names)`` in calls of ``KEYS_PER_CALL`` keys (it blocks on a missing key)."""
    return [bytes(v) for at in range(0, len(names), KEYS_PER_CALL)
            for v in store.multi_get(names[at : at + KEYS_PER_CALL])]


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
