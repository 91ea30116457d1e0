"""A TCPStore client that counts its operations, for ``bench scale`` and the liveness tests.

TCPStore keeps no per-operation counters that Python can read, so each client is wrapped:
``CountingStore(inner, counter)`` forwards every call to ``inner`` and adds one to
``counter`` per round trip (a ``multi_get`` of N keys is one). It subclasses
``torch.distributed.Store``, so torch's own code (``PrefixStore``, the c10d rendezvous
backend) accepts it and is counted the same way. Call order: ``Counter()`` once per process;
``CountingStore(connect(), counter)`` per simulated client; read ``counter.value`` before and
after an interval.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch.distributed as dist

__all__ = ["Counter", "CountingStore"]


class Counter:
    """A thread-safe operation count shared by many clients."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def inc(self) -> None:
        with self._lock:
            self.value += 1


class CountingStore(dist.Store):  # type: ignore[misc,name-defined]
    """``inner``'s operations, each counted once in ``counter``."""

    def __init__(self, inner: Any, counter: Counter) -> None:
        super().__init__()
        self._inner, self._counter = inner, counter

    @property
    def host(self) -> str:
        return str(self._inner.host)

    @property
    def port(self) -> int:
        return int(self._inner.port)

    def set(self, key: str, value: Any) -> None:
        self._counter.inc()
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._counter.inc()
        return bytes(self._inner.get(key))

    def add(self, key: str, amount: int) -> int:
        self._counter.inc()
        return int(self._inner.add(key, amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._counter.inc()
        return bytes(self._inner.compare_set(key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        self._counter.inc()
        return bool(self._inner.check(keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._counter.inc()
        return [bytes(v) for v in self._inner.multi_get(keys)]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._counter.inc()
        self._inner.multi_set(keys, values)

    def delete_key(self, key: str) -> bool:
        self._counter.inc()
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        self._counter.inc()
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._counter.inc()
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)
