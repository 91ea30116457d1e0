"""Simulated agents for ``bench rdzv``: the real ``TierckptRendezvousHandler``, many per process.

Each agent is a handler on a store client of its own (the handler blocks in the store's
``wait``, so agents cannot share one), counted (storecount.py). Two ways to run them
(``settings["sim"]``):

- ``greenlets`` (the default): each agent a greenlet on a pure-Python client of the real store
  server (storewire.py over ``gevent.socket``; ``time.sleep`` is gevent's in these processes), so a
  blocked call costs no thread and a wake-up no thread switch: the simulation of 4096 agents on 2
  cores then costs less than the store does, and the times are the protocol's;
- ``threads``: each agent a thread on torch's own TCPStore client, as the agent runs it; on 2
  cores thousands of threads waking at once set the times (bench rdzv --sim threads, for comparison).

An agent's greenlet or thread exists only while it is inside ``next_rendezvous`` (blocked in
``wait`` nearly all the time); the steady state is one loop per process that polls every member's
``num_nodes_waiting`` once per interval, as each agent's monitor loop does. Call order (the parent,
rdzv.py, over a pipe to each process, every process alike):

    ("connect", agents, n, settings) → {"connected": count}
    ("round", agents, claims) → {"ready": count}: a parked thread per listed agent; then
    ("go", at) → at wall-clock time ``at`` the listed agents' next_rendezvous at once; with
        ``claims`` each registers its rank claim with the handler (as Rounds.gate does: a member of
        the last round keeps its rank and names the membership it knew, a newcomer takes a free
        one) and the round's leader decides the ranks →
        {"done": [(agent, arrived, returned, handler rank, world, group rank, ranked)], "failed": {why: count}}
    ("steady", interval_s, window_s, below_max) → {"ops", "polls", "ticks"}
    ("exit",) → "bye"; the parent ends a process that overruns its limit by pid.
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing
import os
import resource
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from multiprocessing.connection import Connection
from typing import Any

from tierckpt.launcher.membership.ranks import Claim, Decided, exchange_round
from tierckpt.launcher.membership.rdzv import TierckptRendezvousHandler
from tierckpt.testing.storecount import Counter, CountingStore

__all__ = ["serve"]

_STACK = 256 * 1024  # an agent's thread mostly sits in one blocking call: 4096 of them fit in memory


class _SimHandler(TierckptRendezvousHandler):
    """The real handler; on a pure-Python client (greenlets) its round store is that client's prefix
    store (torch's PrefixStore needs a C++ store: its calls into Python would switch greenlets
    inside C++ frames)."""

    wire = False

    def _round_store(self, k: int) -> Any:
        if not self.wire:
            return super()._round_store(k)
        from tierckpt.bench.storewire import WirePrefixStore

        return WirePrefixStore(self._r(k, ""), self.store)


class _Stamped(CountingStore):
    """A counted client that notes when its agent arrived in a round (the handler's ``add(r<k>/n, 1)``)."""

    arrived: float | None = None

    def add(self, key: str, amount: int) -> int:
        got = super().add(key, amount)
        if amount == 1 and key.endswith("/n"):
            self.arrived = time.time()
        return got


class _Known(Mapping[int, str]):
    """A survivor's map of the last round, read only if it is used: the agent (membership/rounds.py)
    reads each round's memberships once its rank is in use, off the round's critical path, in
    parallel with every other node; one machine cannot play that for N agents, so here only the
    survivor that publishes the map (the first with its digest, ranks.exchange_round) reads it,
    and 4096 agents do not each hold a 4096-entry map."""

    def __init__(self, decided: Decided) -> None:
        self._decided = decided
        self._map: Mapping[int, str] | None = None

    def _read(self) -> Mapping[int, str]:
        if self._map is None:
            self._map = self._decided.memberships()[1]
        return self._map

    def __getitem__(self, key: int) -> str:
        return self._read()[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())


class _Agents:
    """This process's share of the agents: a handler each, and the group rank each holds."""

    def __init__(self, port: int, agents: list[int], n: int, s: dict[str, Any], lock: Any) -> None:
        import torch.distributed as dist

        self.greenlets = s.get("sim", "greenlets") == "greenlets"
        self.ops = Counter()
        self.stores: dict[int, _Stamped] = {}
        self.handlers: dict[int, TierckptRendezvousHandler] = {}
        self.rank: dict[int, int] = {}  # group rank after the last round (the ranks exchange's, else the handler's)
        self.decided: dict[int, Decided] = {}  # each agent's view of the last round (the exchange's)
        timeout = datetime.timedelta(seconds=s["store_timeout_s"])
        if self.greenlets:
            import gevent.socket
            from gevent import monkey

            from tierckpt.bench.storewire import WireStore

            monkey.patch_time()  # the handler's time.sleep (the leader's poll) yields to the other agents
        for i in agents:
            with lock:  # one process connects at a time (scale_sim.py: parallel connects stall on this box)
                client = WireStore("127.0.0.1", port, timeout=timeout, socket_module=gevent.socket) \
                    if self.greenlets else \
                    dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)  # type: ignore[attr-defined]
            self.stores[i] = _Stamped(client, self.ops)
            h = self.handlers[i] = _SimHandler(self.stores[i], "bench", min_nodes=n, max_nodes=n,
                                               join_timeout_s=s["join_timeout_s"], poll_s=s["poll_s"])
            h.wire = self.greenlets

    def round(self, agents: list[int], claims: bool, conn: Connection) -> dict[str, Any]:
        """Each listed agent's thread started and parked; "ready" to the parent; at the parent's
        ``("go", at)`` every thread goes at the wall-clock time ``at`` (the moment every node
        learned of the round: real agents are running already, a simulator's thread start is no
        part of the protocol's time)."""
        out: list[tuple[int, float, float, int, int, int, float]] = []
        failed: dict[str, int] = {}
        lock = threading.Lock()
        if self.greenlets:
            import gevent
            import gevent.event

            go: Any = gevent.event.Event()
        else:
            go = threading.Event()

        def agent(i: int) -> None:
            go.wait()
            try:
                out.append(self._agent(i, claims))
            except Exception as exc:  # a timed-out wait, a closed rendezvous: the table names it
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
                with lock:
                    failed[why] = failed.get(why, 0) + 1

        if self.greenlets:
            lets = [gevent.spawn(agent, i) for i in agents]
            conn.send({"ready": len(lets)})
            at = self._go(conn)
            gevent.sleep(max(0.0, at - time.time()))
            go.set()
            gevent.joinall(lets)
            return {"done": out, "failed": failed}
        threading.stack_size(_STACK)
        threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in agents]
        for t in threads:
            t.start()
        conn.send({"ready": len(threads)})
        at = self._go(conn)
        time.sleep(max(0.0, at - time.time()))
        go.set()
        for t in threads:
            t.join()
        return {"done": out, "failed": failed}

    @staticmethod
    def _go(conn: Connection) -> float:
        msg = conn.recv()
        if msg[0] != "go":
            raise ValueError(f"a round's agents wait for 'go', not {msg[0]!r}")
        return float(msg[1])

    def _agent(self, i: int, claims: bool) -> tuple[int, float, float, int, int, int, float]:
        handler = self.handlers[i]
        if claims:  # as Rounds.gate gives it: the round's leader decides the stable ranks
            prior = self.rank.get(i)
            last = self.decided.get(i) if prior is not None else None
            claim = Claim(prior=prior, survivor=last is not None, identity=f"sim{i:05d}:/dev/shm/tierckpt",
                          members=_Known(last) if last is not None else None,
                          digest=last.digest if last is not None else None)
            handler.claim = lambda: claim
        info = handler.next_rendezvous()
        returned = time.time()
        arrived = self.stores[i].arrived or returned
        rank, ranked = info.rank, returned
        if claims:
            got = handler.decided
            if got is None:  # the leader ranked by host: the launcher's exchange after the round
                got = exchange_round(info.store, info.rank, info.world_size, claim)
                ranked = time.time()
            rank = got.rank
            self.decided[i] = got
        self.rank[i] = rank
        return i, arrived, returned, info.rank, info.world_size, rank, ranked

    def steady(self, interval_s: float, window_s: float, below_max: bool) -> dict[str, Any]:
        """Every member's ``num_nodes_waiting`` once per interval for ``window_s``: at ``max_nodes``
        (the handler answers without the store) or, ``below_max``, as an elastic job below its max."""
        members = [h for h in self.handlers.values() if h.round is not None]
        saved = [h.max_nodes for h in members]
        if below_max:
            for h in members:
                h.max_nodes = (h.world or h.max_nodes) + 1
        try:
            ops0 = self.ops.value
            end = time.monotonic() + window_s
            if not self.greenlets:
                polls, ticks = self._poll(members, interval_s, end)
            else:  # 32 greenlets poll a slice each: while one waits for its answer, the others ask
                import gevent

                lets = [gevent.spawn(self._poll, members[k::32], interval_s, end) for k in range(min(32, len(members)))]
                gevent.joinall(lets)
                polls, ticks = sum(g.value[0] for g in lets), min((g.value[1] for g in lets), default=0)
            return {"ops": self.ops.value - ops0, "polls": polls, "ticks": ticks}
        finally:
            for h, m in zip(members, saved, strict=True):
                h.max_nodes = m


    @staticmethod
    def _poll(members: list[TierckptRendezvousHandler], interval_s: float, end: float) -> tuple[int, int]:
        """``num_nodes_waiting`` of each of ``members`` once per interval until ``end``; (polls, intervals)."""
        polls, ticks = 0, 0
        next_tick = time.monotonic()
        while time.monotonic() < end:
            for h in members:
                h.num_nodes_waiting()
            polls += len(members)
            ticks += 1
            next_tick += interval_s
            time.sleep(max(0.0, next_tick - time.monotonic()))
        return polls, ticks


def serve(conn: Connection, port: int, connect_lock: Any) -> None:
    """A simulation process's loop (multiprocessing target); see the module docstring."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: ends with the bench, even a SIGKILLed one
    bench = multiprocessing.parent_process()
    if bench is not None and os.getppid() != bench.pid:  # it died while this one imported: no signal will come
        os._exit(0)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a socket per agent
    agents: _Agents | None = None
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the bench is gone
            os._exit(0)
        op = msg[0]
        if op == "connect":
            agents = _Agents(port, msg[1], msg[2], msg[3], connect_lock)
            conn.send({"connected": len(agents.handlers)})
        elif op == "exit":
            conn.send("bye")
            return
        elif agents is None:
            conn.send({"error": f"{op!r} before connect"})
        elif op == "round":
            conn.send(agents.round(msg[1], msg[2], conn))
        elif op == "steady":
            conn.send(agents.steady(msg[1], msg[2], msg[3]))
