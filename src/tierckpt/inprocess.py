"""In-process restarts: on a fault every rank leaves the step, rebuilds the process group and
rolls back from its own memory tier, in the same interpreter (imports and compiled graphs stay).

    import tierckpt
    model = torch.compile(build_model())          # built once: survives every restart

    def train(gen: tierckpt.Generation) -> None:   # one call per in-process generation
        with tierckpt.Checkpointer(cfg) as ck:     # on the generation's process group
            start = ck.load(state) or 0             # roll back: a memcpy from this node's memory
            for step in range(start + 1, total + 1):
                loss = train_step()
                monitor.step(step, loss=loss.item())   # a NaN/Inf raises here: restart in-process
                ck.save(step, state)

    tierckpt.resilient(train)()

Call order (every rank, the main thread): ``resilient(fn)()`` connects the coordination store
once: under ``tierckpt run`` the one its group-rank-0 agent hosts (``TIERCKPT_INPROC_STORE=
host:port/scope``, keys under ``tierckpt/inproc/<scope>/``, so it outlives any worker), else
``MASTER_ADDR``/``MASTER_PORT`` with rank 0 hosting it, as ``init_process_group("env://")`` would;
then per generation k: ``init_process_group`` on the store prefix ``<keys>/<k>/pg``, a
watchdog thread (``inprocess_watch``), ``fn(gen)``. A fault is one of: an exception out of ``fn`` on
any rank (a non-finite ``monitor.step`` loss is one), another rank's fault (a key in the store),
or a request of ``tierckpt run`` (``inproc_request`` in ``TIERCKPT_MONITOR_DIR``: a hang, a
NaN seen by the launcher). The rank that sees it first marks it in the store; every rank then
aborts its group (for gloo: shuts down the group's sockets, which unblocks a peer stuck in a
collective at once; ``destroy_process_group`` and ``ProcessGroup.abort`` do not; for NCCL:
``abort``), and a rank outside any collective gets ``RestartRequested`` raised in its main
thread (SIGUSR2). Then ``destroy_process_group``, a store barrier (every rank left k) and
generation k+1. A rank whose process died comes back as a replacement process that
``tierckpt run`` starts with ``TIERCKPT_INPROC_JOIN=<reason>`` (agent-hosted store only): it reads
the current generation k from the store, marks the fault (and ``<k>/crash``, which names the
reason of k+1 on every rank), counts itself in k's barrier for the dead rank and joins k+1.
Without a replacement the barrier times out and ``InProcessRestartError`` ends the process, so
``tierckpt run`` restarts the processes.

Each restart is appended to ``inproc_<local rank>.jsonl`` in ``TIERCKPT_MONITOR_DIR`` (the
launcher turns it into a ``restart`` event with ``kind="inprocess"``).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Generic, TypeVar

import torch.distributed as dist

from tierckpt import monitor, workerenv
from tierckpt.dcp import plancache
from tierckpt.errors import InProcessRestartError, RestartRequested

__all__ = ["Generation", "Resilient", "resilient"]

T = TypeVar("T")
_SIGNAL = signal.SIGUSR2
_POLL_S = 0.05
_GRACE_S = 0.3  # a rank inside a collective leaves it by the abort; the signal is for the others


@dataclass(frozen=True)
class Generation:
    """What ``fn`` is told at each call: which in-process generation, and why the last one ended."""

    index: int
    rank: int
    world_size: int
    reason: str | None = None  # the fault that ended the previous generation
    stages_s: dict[str, float] = field(default_factory=dict)  # the previous recovery's stages
    fault_time: float | None = None  # wall time the fault was first seen on this rank


class _Aborter:
    """Unblocks the ranks of one process group: gloo's connected sockets shut down, NCCL aborted."""

    def __init__(self, before: set[int], backend: str) -> None:
        self.backend = backend
        self.fds = [fd for fd in _open_fds() - before if _is_connected_socket(fd)]

    def abort(self) -> None:
        if self.backend == "nccl":
            pg = dist.group.WORLD
            if pg is not None and hasattr(pg, "abort"):
                pg.abort()
            return
        for fd in self.fds:
            try:
                sk = socket.socket(fileno=fd)
            except OSError:  # already closed by the group's own teardown
                continue
            try:
                sk.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already disconnected: the peer went first
            finally:
                sk.detach()


class Resilient(Generic[T]):
    """``fn`` run until it returns, restarted in-process on a fault; see the module doc."""

    def __init__(self, fn: Callable[[Generation], T], *, backend: str = "gloo", max_restarts: int = 10,
                 rejoin_timeout_s: float = 60.0, collective_timeout_s: float = 1800.0) -> None:
        self.fn = fn
        self.backend = backend
        self.max_restarts = max_restarts
        self.rejoin_timeout_s = rejoin_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self._armed = False
        self._fault = threading.Event()
        self._reason: str | None = None
        self._fault_time: float | None = None
        self._keys = "tierckpt/inproc/"

    def __call__(self) -> T:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store, watch_store, self._keys = _connect(rank, world, self.rejoin_timeout_s)
        monitor_dir = os.environ.get(workerenv.MONITOR_DIR)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        report = os.path.join(monitor_dir, workerenv.inproc_report(local_rank)) if monitor_dir else None
        previous = signal.signal(_SIGNAL, self._on_signal)
        joining = os.environ.get(workerenv.INPROC_JOIN) if os.environ.get(workerenv.INPROC_STORE) else None
        gen = Generation(0, rank, world) if not joining else self._join(store, joining, rank, world, report)
        _report(report, event="ready", k=gen.index, rank=rank, pid=os.getpid(),
                store="agent" if os.environ.get(workerenv.INPROC_STORE) else "rank0")
        try:
            while True:
                t_pg = time.time()
                store.set(f"{self._keys}current", str(gen.index))  # what a replacement process joins
                aborter = self._init_group(store, gen.index, rank, world)
                gen.stages_s["pg"] = time.time() - t_pg
                watchdog = threading.Thread(target=self._watch, name="tierckpt-inprocess-watch", daemon=True,
                                            args=(watch_store, gen.index, aborter, monitor_dir))
                self._fault.clear()
                self._reason = self._fault_time = None
                # DCP's plan caches are per process: a survivor's would not match a replacement's
                plancache.clear_all()
                watchdog.start()
                self._armed = True
                try:
                    result = self.fn(gen)
                    self._armed = False
                    self._fault.set()  # stops the watchdog
                    watchdog.join()
                    dist.destroy_process_group()
                    return result
                except Exception as exc:
                    self._armed = False
                    gen = self._recover(exc, gen, store, aborter, watchdog, report)
        finally:
            self._armed = False
            signal.signal(_SIGNAL, previous)
            monitor.set_non_finite_hook(None)

    def _init_group(self, store: Any, k: int, rank: int, world: int) -> _Aborter:
        if self.backend == "nccl":  # on a NCCL error abort the communicator only; 1 and 3 end the process
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        before = _open_fds()
        dist.init_process_group(self.backend, store=dist.PrefixStore(  # type: ignore[attr-defined]
            f"{self._keys}{k}/pg", store), rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=self.collective_timeout_s))
        monitor.set_non_finite_hook(_raise_non_finite)
        return _Aborter(before, self.backend)

    def _recover(self, exc: Exception, gen: Generation, store: Any, aborter: _Aborter,
                 watchdog: threading.Thread, report: str | None) -> Generation:
        """Mark the fault, abort and destroy the group, wait for every rank; the next generation."""
        t_left = time.time()
        k = gen.index
        mine = self._reason or (exc.reason if isinstance(exc, RestartRequested) else type(exc).__name__)
        t_fault = self._fault_time or t_left
        # the first fault marked wins: a peer's "connection closed" names the cause, not itself
        first = store.compare_set(f"{self._keys}{k}/fault", "", f"{mine} on rank {gen.rank}")
        marked = bytes(first).decode()
        reason = marked.split(" on rank ")[0] or mine
        culprit = _rank_of(marked, gen.rank)  # whose fault it was: the first rank that marked one
        aborter.abort()
        self._fault.set()
        watchdog.join()
        _destroy_quietly()
        t_stop = time.time()
        if k >= self.max_restarts:
            raise InProcessRestartError(f"{self.max_restarts} in-process restarts used up; last fault: {reason}",
                                        generation=k) from exc
        self._barrier(store, k, gen.world_size, exc)
        replaced = bool(store.check([f"{self._keys}{k}/crash"]))
        if replaced:  # a replacement joined for a dead rank: that is the cause
            reason = store.get(f"{self._keys}{k}/crash").decode()
        stages = {"leave": t_left - t_fault, "stop": t_stop - t_left, "barrier": time.time() - t_stop}
        _report(report, event="restart", k=k + 1, rank=gen.rank, reason=reason, pid=os.getpid(),
                fault_time=t_fault, error=f"{type(exc).__name__}: {exc}"[:300], stages_s=stages, replaced=replaced,
                **({} if reason == "launcher request" else {"fault_rank": culprit}))
        return Generation(k + 1, gen.rank, gen.world_size, reason=reason, stages_s=stages, fault_time=t_fault)

    def _watch(self, store: Any, k: int, aborter: _Aborter, monitor_dir: str | None) -> None:
        """Watchdog thread: a peer's fault key or the launcher's request aborts the group."""
        key = f"{self._keys}{k}/fault"
        request = os.path.join(monitor_dir, workerenv.INPROC_REQUEST) if monitor_dir else None
        seen = _read_counter(request)
        while not self._fault.wait(_POLL_S):
            reason = None
            if store.check([key]):
                reason = store.get(key).decode() or "peer fault"
            elif request is not None and _read_counter(request) > seen:
                reason = "launcher request"
                store.compare_set(key, "", reason)
            if reason is None:
                continue
            self._reason, self._fault_time = reason.split(" on rank ")[0], time.time()
            aborter.abort()
            if self._fault.wait(_GRACE_S) or not self._armed:
                return
            signal.pthread_kill(threading.main_thread().ident or 0, _SIGNAL)
            return

    def _barrier(self, store: Any, k: int, world: int, exc: BaseException | None) -> None:
        """Count this rank out of generation k; wait until every rank (or its replacement) did."""
        store.add(f"{self._keys}{k}/left", 1)
        deadline = time.monotonic() + self.rejoin_timeout_s
        while int(store.add(f"{self._keys}{k}/left", 0)) < world:
            if time.monotonic() > deadline:
                raise InProcessRestartError(f"not every rank left generation {k} within {self.rejoin_timeout_s:g}s "
                                            "(a process died?): the launcher restarts the processes",
                                            generation=k) from exc
            time.sleep(0.005)

    def _join(self, store: Any, reason: str, rank: int, world: int, report: str | None) -> Generation:
        """A replacement process: stand in for the dead ``rank`` in the barrier of the current
        generation k, naming ``reason`` as the fault, and start at k+1 with the survivors."""
        t0 = time.time()
        k = int(store.get(f"{self._keys}current"))
        store.compare_set(f"{self._keys}{k}/fault", "", f"{reason} on rank {rank}")
        store.set(f"{self._keys}{k}/crash", reason)  # before the barrier: every rank reads it after
        if k >= self.max_restarts:
            raise InProcessRestartError(f"{self.max_restarts} in-process restarts used up; last fault: {reason}",
                                        generation=k)
        self._barrier(store, k, world, None)
        stages = {"barrier": time.time() - t0}
        _report(report, event="restart", k=k + 1, rank=rank, reason=reason, pid=os.getpid(), fault_time=t0,
                error=None, stages_s=stages, joined=True, replaced=True)
        return Generation(k + 1, rank, world, reason=reason, stages_s=stages, fault_time=t0)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._armed:
            self._armed = False
            raise RestartRequested(self._reason or "fault")


def resilient(fn: Callable[[Generation], T], *, backend: str = "gloo", max_restarts: int = 10,
              rejoin_timeout_s: float = 60.0) -> Resilient[T]:
    """``fn`` wrapped for in-process restarts; call the result from the main thread of every rank."""
    return Resilient(fn, backend=backend, max_restarts=max_restarts, rejoin_timeout_s=rejoin_timeout_s)


def _connect(rank: int, world: int, timeout_s: float) -> tuple[Any, Any, str]:
    """(store, the watchdog's store, key prefix): the agent-hosted store when ``tierckpt run``
    names one (``TIERCKPT_INPROC_STORE``), else the job's ``MASTER_ADDR:MASTER_PORT`` hosted by rank 0."""
    timeout = datetime.timedelta(seconds=timeout_s)
    hosted = os.environ.get(workerenv.INPROC_STORE)
    if hosted:
        addr, _, scope = hosted.partition("/")
        where, _, digits = addr.rpartition(":")
        if not where or not digits.isdigit() or not scope:
            raise InProcessRestartError(f"{workerenv.INPROC_STORE}={hosted!r} is not host:port/scope; unset it to use "
                                        "MASTER_ADDR/MASTER_PORT", generation=0)
        stores = [dist.TCPStore(where, int(digits), None, False, timeout=timeout,  # type: ignore[attr-defined]
                                wait_for_workers=False) for _ in range(2)]
        return stores[0], stores[1], f"tierckpt/inproc/{scope}/"
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, world, rank == 0, timeout=timeout)  # type: ignore[attr-defined]
    watch = dist.TCPStore(host, port, world, False, timeout=timeout)  # type: ignore[attr-defined]
    return store, watch, "tierckpt/inproc/"


def _raise_non_finite(step: int, loss: float | None) -> None:
    raise RestartRequested(monitor.NON_FINITE_LOSS, step=step)


def _destroy_quietly() -> None:
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - an aborted group may fail its own teardown; it is gone either way
        pass


def _open_fds() -> set[int]:
    return {int(f) for f in os.listdir("/proc/self/fd")}


def _is_connected_socket(fd: int) -> bool:
    """A connected stream socket (a gloo pair); never a listener, whose shutdown aborts gloo."""
    try:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
            return False
        sk = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        return not sk.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        return False
    finally:
        sk.detach()


def _read_counter(path: str | None) -> int:
    if path is None:
        return 0
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def _report(path: str | None, **rec: Any) -> None:
    if path is None:
        return
    with open(path, "a") as f:
        f.write(json.dumps({"time": time.time(), **rec}) + "\n")


def _rank_of(marked: str, default: int) -> int:
    """The rank named by a fault mark (``"<reason> on rank <r>"``); ``default`` when it names none."""
    _, sep, rank = marked.rpartition(" on rank ")
    return int(rank) if sep and rank.isdigit() else default
