"""A TCPStore client in pure Python, speaking torch's wire protocol: ``bench rdzv``'s simulated agents
as greenlets (rdzv_sim.py), thousands in one process, against the real store server.

torch's client (C++) blocks its thread in every call; 4096 simulated agents then need 4096 threads,
and on 2 cores the simulation, not the protocol, set the times (the threads' wake-ups: 140-180 % of
the two cores while the store used 10-30 %). This client's socket is a plain Python one, so under
gevent (``gevent.socket``) a blocked call yields to the next agent. It serves the calls the
rendezvous handler and the rank exchange make (``set``, ``get``, ``add``, ``compare_set``,
``check``, ``wait``, ``multi_get``, ``multi_set``) with the semantics of torch's client: every key
goes out under torch's client prefix ``/`` (a key set here is the key torch's client reads),
``get`` and ``multi_get`` first wait for their keys (up to the client's timeout), a ``wait`` that
times out cancels itself on the server and raises ``torch.distributed.DistStoreError``. Pinned
against torch's own client and the libuv server by ``tests/bench/test_storewire.py``.

The wire: a one-byte query type, then its fields; a string or a byte vector is its length (uint64)
and its bytes; numbers are native little-endian (``QueryType`` in torch's ``TCPStoreBackend.hpp``).

Call order: ``WireStore(host, port, socket_module=gevent.socket)`` once per agent (it validates
itself to the server), its calls from one greenlet at a time, ``close()``.
"""

from __future__ import annotations

import datetime
import socket as std_socket
import struct
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["WirePrefixStore", "WireStore"]

# torch/csrc/distributed/c10d/TCPStoreBackend.hpp: QueryType, the validation number, the responses
_VALIDATE, _SET, _COMPARE_SET, _GET, _ADD, _CHECK, _WAIT = 0, 1, 2, 3, 4, 5, 6
_MULTI_GET, _MULTI_SET, _CANCEL_WAIT = 10, 11, 12
_MAGIC = 0x3C85F7CE
_READY = 0  # CheckResponseType
_STOP_WAITING, _WAIT_CANCELED = 0, 1  # WaitResponseType
_PREFIX = "/"  # torch's TCPStore client sends every key under it
_Q = struct.Struct("<Q")
_q = struct.Struct("<q")


def _bytes(v: Any) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


def _vec(v: bytes) -> bytes:
    return _Q.pack(len(v)) + v


def _key(k: str) -> bytes:
    return _vec((_PREFIX + k).encode())


def _keys(keys: Sequence[str]) -> bytes:
    return _Q.pack(len(keys)) + b"".join(_key(k) for k in keys)


class WireStore:
    """One connection to a TCPStore server; torch's client's calls and semantics (see the module doc)."""

    def __init__(self, host: str, port: int, *, timeout: datetime.timedelta = datetime.timedelta(seconds=300),
                 socket_module: ModuleType | Any = std_socket) -> None:
        self.host, self.port = host, port
        self.timeout = timeout
        self._sock = socket_module.create_connection((host, port))
        self._sock.setsockopt(std_socket.IPPROTO_TCP, std_socket.TCP_NODELAY, 1)
        self._buf = bytearray()
        self._sock.sendall(bytes([_VALIDATE]) + struct.pack("<I", _MAGIC))

    def close(self) -> None:
        self._sock.close()

    # ---- receiving ----
    def _exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            got = self._sock.recv(max(65536, n - len(self._buf)))
            if not got:
                raise _dist().DistNetworkError(f"the store at {self.host}:{self.port} closed the connection")
            self._buf += got
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def _vec(self) -> bytes:
        return self._exact(_Q.unpack(self._exact(8))[0])

    # ---- torch's calls ----
    def set(self, key: str, value: Any) -> None:
        self._sock.sendall(bytes([_SET]) + _key(key) + _vec(_bytes(value)))

    def get(self, key: str) -> bytes:
        self.wait([key])
        self._sock.sendall(bytes([_GET]) + _key(key))
        return self._vec()

    def add(self, key: str, amount: int) -> int:
        self._sock.sendall(bytes([_ADD]) + _key(key) + _q.pack(int(amount)))
        return int(_q.unpack(self._exact(8))[0])

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._sock.sendall(bytes([_COMPARE_SET]) + _key(key) + _vec(_bytes(expected)) + _vec(_bytes(desired)))
        return self._vec()

    def check(self, keys: Sequence[str]) -> bool:
        self._sock.sendall(bytes([_CHECK]) + _keys(keys))
        return self._exact(1)[0] == _READY

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        """Until every key is set; past ``timeout`` (the client's by default) the wait is
        cancelled on the server and ``DistStoreError`` raised, as torch's client does."""
        limit = (timeout or self.timeout).total_seconds()
        self._sock.sendall(bytes([_WAIT]) + _keys(keys))
        if self._buf:
            got = self._exact(1)[0]
        else:
            self._sock.settimeout(max(limit, 0.001))
            try:
                got = self._exact(1)[0]
            except TimeoutError:
                got = None
            finally:
                self._sock.settimeout(None)
        if got is not None:
            if got != _STOP_WAITING:
                raise _dist().DistStoreError(f"wait: unexpected response {got} from the store")
            return
        self._sock.sendall(bytes([_CANCEL_WAIT]))
        got = self._exact(1)[0]
        if got == _STOP_WAITING:  # the keys came before the cancel reached the server: its answer follows
            got = self._exact(1)[0]
        if got != _WAIT_CANCELED:
            raise _dist().DistStoreError(f"wait: unexpected response {got} to a cancel from the store")
        raise _dist().DistStoreError(f"wait timeout after {int(limit * 1000)}ms, keys: {list(keys)}")

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self.wait(keys)
        self._sock.sendall(bytes([_MULTI_GET]) + _keys(keys))
        return [self._vec() for _ in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys, {len(values)} values")
        body = b"".join(_key(k) + _vec(_bytes(v)) for k, v in zip(keys, values, strict=True))
        self._sock.sendall(bytes([_MULTI_SET]) + _Q.pack(len(keys)) + body)


class WirePrefixStore:
    """``torch.distributed.PrefixStore`` for a ``WireStore`` (or a wrapper of one): ``prefix`` and
    a ``/`` before every key, as torch's joins them; the calls the rank exchange makes."""

    def __init__(self, prefix: str, store: Any) -> None:
        self.prefix, self.store = prefix, store

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value: Any) -> None:
        self.store.set(self._k(key), value)

    def get(self, key: str) -> bytes:
        return bytes(self.store.get(self._k(key)))

    def add(self, key: str, amount: int) -> int:
        return int(self.store.add(self._k(key), amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self.store.compare_set(self._k(key), expected, desired))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self.store.check([self._k(k) for k in keys]))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        self.store.wait([self._k(k) for k in keys], *([timeout] if timeout is not None else []))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [bytes(v) for v in self.store.multi_get([self._k(k) for k in keys])]

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        self.store.multi_set([self._k(k) for k in keys], list(values))


def _dist() -> Any:
    import torch.distributed as dist

    return dist
