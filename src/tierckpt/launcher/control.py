"""The job's control plane on the rendezvous store: one generation, fault claims, stop barrier, liveness.

Every key lives under ``tierckpt/run/`` of the c10d rendezvous TCPStore (the store torch's
agents already share), so there is no second server. Call order, on every agent:

    ctl = JobControl(job_store)
    g = ctl.join(round_store, nnodes, local_next=..., local_full=...)  # after each rendezvous round
    ...every monitor tick:  rec = ctl.claimed(g)                       # a fault anywhere in generation g
    ...on a local fault:    rec = ctl.claim(g, record)                 # first claim wins; returns the winner
    ...after stopping:      ctl.stopped(g); ctl.wait_stopped(g, nnodes, timeout)
    ...master of g + 1:     ctl.publish_master(g + 1, addr, port) / ctl.master(g + 1, timeout)

The generation is job-wide and monotonic: a claim for generation g moves the stored
generation to g + 1, and every agent starts g + 1 after the stop barrier, so two agents can
never run workers of different generations (pytorch#135712). Workers of each generation meet
on a fresh TCPStore port published here, so no key of an older generation is ever read.
``Liveness`` runs in a thread with its own store client and reports agents whose counter
stopped moving.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["JobControl", "Liveness"]

_P = "tierckpt/run/"


def _store_error_types() -> tuple[type[BaseException], ...]:
    import torch.distributed as dist

    return (RuntimeError, dist.DistError) if hasattr(dist, "DistError") else (RuntimeError,)


class JobControl:
    """Reads and writes the job-wide keys; every method is one or a few store round trips."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def _raise_to(self, key: str, value: int) -> int:
        """Set ``key`` to max(current, value) atomically; return the result."""
        while True:
            cur_raw = self.store.get(_P + key) if self.store.check([_P + key]) else None
            cur = int(cur_raw) if cur_raw is not None else None
            if cur is not None and cur >= value:
                return cur
            expected = b"" if cur_raw is None else cur_raw
            got = self.store.compare_set(_P + key, expected, str(value).encode())
            if int(got) >= value:
                return int(got)

    def get_int(self, key: str, default: int = 0) -> int:
        return int(self.store.get(_P + key)) if self.store.check([_P + key]) else default

    def join(self, round_store: Any, nnodes: int, *, local_next: int, local_full: int,
             timeout: float = 600.0) -> tuple[int, int]:
        """Agree on (generation, full restarts) after a rendezvous round; blocks until all joined."""
        self._raise_to("generation", local_next)
        self._raise_to("full_restarts", local_full)
        round_store.add("tierckpt/joined", 1)
        deadline = time.monotonic() + timeout
        while int(round_store.add("tierckpt/joined", 0)) < nnodes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every agent joined within {timeout:.0f}s")
            time.sleep(0.01)
        return self.get_int("generation"), self.get_int("full_restarts")

    def claimed(self, generation: int) -> dict[str, Any] | None:
        key = f"{_P}fault/{generation}"
        if not self.store.check([key]):
            return None
        return dict(json.loads(self.store.get(key)))

    def claim(self, generation: int, record: dict[str, Any]) -> dict[str, Any]:
        """Report a fault of ``generation``; the first claim wins and is returned to everyone."""
        key = f"{_P}fault/{generation}"
        got = self.store.compare_set(key, b"", json.dumps(record).encode())
        self._raise_to("generation", generation + 1)
        return dict(json.loads(got))

    def history(self, generation: int) -> list[dict[str, Any]]:
        """Every claimed fault of generations 0..generation, oldest first."""
        out = []
        for g in range(generation + 1):
            rec = self.claimed(g)
            if rec is not None:
                out.append(rec)
        return out

    def stopped(self, generation: int) -> None:
        self.store.add(f"{_P}stopped/{generation}", 1)

    def wait_stopped(self, generation: int, nnodes: int, timeout: float) -> bool:
        """True when every agent stopped its workers of ``generation`` within ``timeout``."""
        deadline = time.monotonic() + timeout
        while int(self.store.add(f"{_P}stopped/{generation}", 0)) < nnodes:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def publish_master(self, generation: int, addr: str, port: int) -> None:
        self.store.set(f"{_P}master/{generation}", f"{addr}:{port}".encode())

    def master(self, generation: int, timeout: float) -> tuple[str, int]:
        key = f"{_P}master/{generation}"
        deadline = time.monotonic() + timeout
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the master address of generation {generation} was not published")
            time.sleep(0.005)
        addr, _, port = self.store.get(key).decode().rpartition(":")
        return addr, int(port)

    def set_progress(self, generation: int, node: int, step: int) -> None:
        self.store.set(f"{_P}progress/{generation}/{node}", str(step).encode())

    def job_secret(self) -> bytes:
        """The job's node-agent secret: the first agent to ask generates it (``compare_set``), every
        later one reads the same; only for agents given no secret of their own (``--agent-secret-file``)."""
        import secrets

        return bytes(self.store.compare_set(f"{_P}agent-secret", "", secrets.token_hex(32)))

    def publish_agent(self, node: int, host: str, port: int) -> None:
        """This node's hosted node agent listens on ``host:port`` (peer discovery)."""
        self.store.set(f"{_P}agent/{node}", f"{host}:{port}".encode())

    def agents(self, nnodes: int) -> list[tuple[str, int]]:
        """The node agents published so far by nodes ``0 .. nnodes-1`` (never blocks)."""
        found = []
        for node in range(nnodes):
            key = f"{_P}agent/{node}"
            if self.store.check([key]):
                host, _, port = self.store.get(key).decode().rpartition(":")
                found.append((host, int(port)))
        return found

    def mark_done(self, node: int) -> None:
        self.store.set(f"{_P}done/{node}", b"1")


class Liveness:
    """A thread that bumps this agent's counter and notices agents whose counter stalls.

    ``lost()`` lists the group ranks silent for longer than ``timeout_s``; ``reset(nodes)``
    starts watching a new membership (after a rendezvous round). A store failure (the store's
    host is gone) is reported by ``store_error``.
    """

    def __init__(self, connect: Callable[[], Any], node: int, *, interval_s: float, timeout_s: float) -> None:
        self._connect = connect
        self.node = node
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._peers: dict[int, tuple[int, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.store_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="tierckpt-liveness", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def reset(self, node: int, nodes: list[int]) -> None:
        now = time.monotonic()
        with self._lock:
            self.node = node
            self._peers = {n: (-1, now) for n in nodes if n != node}

    def lost(self) -> list[int]:
        now = time.monotonic()
        with self._lock:
            return sorted(n for n, (_, t) in self._peers.items() if now - t > self.timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        errors = _store_error_types()
        try:
            store = self._connect()
        except errors as exc:
            self.store_error = str(exc)
            return
        failures = 0
        while not self._stop.wait(self.interval_s):
            try:
                store.add(f"{_P}alive/{self.node}", 1)
                with self._lock:
                    peers = list(self._peers)
                values = {n: int(store.add(f"{_P}alive/{n}", 0)) for n in peers}
                failures = 0
            except errors as exc:
                failures += 1
                if failures * self.interval_s > self.timeout_s:
                    self.store_error = str(exc)
                continue
            now = time.monotonic()
            with self._lock:
                for n, v in values.items():
                    if n in self._peers and self._peers[n][0] != v:
                        self._peers[n] = (v, now)


def connect_client(host: str, port: int, timeout_s: float = 30.0) -> Any:
    """A new TCPStore client for ``host:port`` (one per thread that needs the store)."""
    import torch.distributed as dist

    return dist.TCPStore(  # type: ignore[attr-defined]
        host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
