"""Simulated agents for ``bench scale``: one process holds many, one thread (or two) per agent.

Control plane only: no workers. Each of ours is the real ``JobControl`` and ``Liveness`` on
counted clients (storecount.py) of the run's TCPStore; each of torch's is the real
``DynamicRendezvousHandler`` with the c10d backend. Call order (the parent, scale.py, over a
pipe to each process, every process alike):

    ours:  ("ours", nodes, n, settings) → "ready"; ("start",); ("count",) → ops and ticks;
           ("generation", g, victim) → each agent but the victim follows g's claim (claimwatch.py), claims
           LostNode when its liveness reports one, stops, agrees on g + 1 →
           {"done": [(node, seen, agreed)], "failed": {why: count}}
    torch: ("torch", nodes, n, settings) → "ready"; ("first",) → every handler's next_rendezvous;
           ("kill", node) → that handler stops its keep-alive; ("again",) → the others' next round
    ("exit",) at the end; the parent ends a process that overruns its limit by pid.
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from tierckpt.launcher.control.claimwatch import ClaimWatch
from tierckpt.launcher.control.jobcontrol import JobControl, Liveness
from tierckpt.testing.storecount import Counter, CountingStore

__all__ = ["BenchError", "serve"]


class BenchError(RuntimeError):
    """A figure the simulation should have produced is missing."""

_MONITOR_TICK_S = 0.1  # tierckpt run's --monitor-interval


def _client(port: int, timeout_s: float, lock: Any) -> Any:
    """A new client; one process at a time connects: clients connecting at once stall for
    seconds on this box (4 processes in parallel: ~5 connections a second)."""
    import torch.distributed as dist

    with lock:  # shared by every simulation process
        return dist.TCPStore("127.0.0.1", port, is_master=False,  # type: ignore[attr-defined]
                             timeout=datetime.timedelta(seconds=timeout_s))


class _Ours:
    """This process's share of our agents: counted clients, one Liveness thread each."""

    def __init__(self, port: int, nodes: list[int], n: int, s: dict[str, Any], lock: Any) -> None:
        self.n, self.s = n, s
        self.ctl_ops, self.live_ops = Counter(), Counter()
        self.ctl = {i: JobControl(CountingStore(_client(port, s["store_timeout_s"], lock), self.ctl_ops)) for i in nodes}
        # the agent's claim watch: one more client each, blocked in the store's wait (claimwatch.py)
        self.woke = {i: threading.Event() for i in nodes}
        self.claims = {i: ClaimWatch(lambda c=CountingStore(_client(port, s["store_timeout_s"], lock),  # type: ignore[misc]
                                                             self.ctl_ops): c, self.woke[i].set) for i in nodes}
        live_clients = {i: CountingStore(_client(port, s["store_timeout_s"], lock), self.live_ops) for i in nodes}
        self.live = {i: Liveness(lambda c=live_clients[i]: c, i, interval_s=s["interval_s"],  # type: ignore[misc]
                                 timeout_s=s["node_timeout_s"]) for i in nodes}
        for i, live in self.live.items():
            live.reset(i, list(range(n)), epoch=0)

    def start(self) -> None:
        """Every process is connected (a job's agents have joined): the liveness threads start."""
        for live in self.live.values():
            live.start()

    def count(self) -> dict[str, Any]:
        return {"ctl": self.ctl_ops.value, "live": self.live_ops.value,
                "ticks": sum(live.ticks for live in self.live.values()),
                "watching": [i for i, live in self.live.items() if live.watching]}

    def generation(self, g: int, victim: int | None) -> dict[str, Any]:
        """``{"done": [(node, seen, agreed)], "failed": {why: count}}`` once every agent of this share ended."""
        if victim is not None and victim in self.live:
            self.live.pop(victim).close()  # the node is gone: no beat, no claim, no ack
            self.ctl.pop(victim)
            self.claims.pop(victim).close()
        out: list[tuple[int, float, float]] = []
        failed: dict[str, int] = {}

        def agent(node: int) -> None:
            try:
                why = self._agent(node, g, out)
            except Exception as exc:  # a store wait that timed out: the figure names it
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
            if why:
                failed[why] = failed.get(why, 0) + 1

        threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in self.ctl]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return {"done": out, "failed": failed}

    def _agent(self, node: int, g: int, out: list[tuple[int, float, float]]) -> str | None:
        """The agent loop's control-plane part: wait for g's claim (or claim a lost node), stop,
        then agree on g + 1: in place after a fault, or regrouped without the lost nodes. Returns
        why it did not get there, or None."""
        ctl, live, timeout = self.ctl[node], self.live[node], self.s["node_timeout_s"] * 4 + 30
        watch, woke = self.claims[node], self.woke[node]
        deadline = time.monotonic() + timeout
        rec = None
        while rec is None and time.monotonic() < deadline:  # tierckpt run's monitor loop, a tick at a time
            watch.follow(g)
            rec = ctl.claimed(g) if watch.due(g) else None  # the store's wake-up, or the safety read
            lost = live.lost()
            if rec is None and lost:
                rec = ctl.claim(g, {"reason": "LostNode", "node": lost[0], "lost": lost, "time": time.time()})
            if rec is None:
                woke.wait(_MONITOR_TICK_S)  # a claim wakes the loop at once, as a worker's exit does the agent's
                woke.clear()
        if rec is None:
            return "no claim seen"
        seen = time.time()
        ctl.stopped(g)
        lost = [int(x) for x in rec.get("lost", [])]
        if lost:  # re-rendezvous without a rendezvous round: the survivors regroup
            survivors = [i for i in range(self.n) if i not in lost]
            got = ctl.regroup(g, node, survivors, timeout=timeout)
            if got is None:
                return "counted lost" if node in lost else "regroup incomplete"
            rank = got[0]
        else:
            if not ctl.wait_stopped(g, self.n, timeout=timeout):
                return "stop barrier incomplete"
            rank = node
        if rank == 0:
            ctl.publish_master(g + 1, "127.0.0.1", 29500 + g)
        else:
            ctl.master(g + 1, timeout=timeout)
        out.append((node, seen, time.time()))
        return None

    def close(self) -> None:
        for live in self.live.values():
            live.close()
        for watch in self.claims.values():
            watch.close(timeout_s=0.0)
        if self.ctl:  # one release per generation ends every watch of this process (they wait on one key each)
            ctl = next(iter(self.ctl.values()))
            for g in (0, 1):
                ctl.release_claim_waiters(g)


class _Torch:
    """This process's share of torch's agents: one DynamicRendezvousHandler (c10d) each."""

    def __init__(self, port: int, nodes: list[int], n: int, s: dict[str, Any], lock: Any) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        self.ops = Counter()
        self.handlers: dict[int, Any] = {}
        for i in nodes:
            store = CountingStore(_client(port, s["store_timeout_s"], lock), self.ops)
            params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="scale",
                                          min_nodes=max(1, n - 1), max_nodes=n, local_addr="127.0.0.1",
                                          **s["torch_conf"])
            self.handlers[i] = create_handler(store, C10dRendezvousBackend(store, "scale"), params)

    def rendezvous(self) -> list[tuple[int, float, int]]:
        """Every handler's next_rendezvous at once: [(node, done, world size)]."""
        out: list[tuple[int, float, int]] = []

        def one(i: int) -> None:
            info = self.handlers[i].next_rendezvous()
            out.append((i, time.time(), int(info.world_size)))

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in self.handlers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def kill(self, node: int) -> None:
        h = self.handlers.pop(node, None)
        if h is not None:  # a dead agent's keep-alive stops; torch has no public call for it
            getattr(h, "_stop_heartbeats", lambda: None)()


def _answer(conn: Connection, lock: threading.Lock, fn: Any, *args: Any) -> None:
    result = fn(*args)
    with lock:
        conn.send(result)


def serve(conn: Connection, port: int, connect_lock: Any) -> None:
    """A simulation process's loop (multiprocessing target); see the module docstring."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: ends with the bench, even a SIGKILLed one
    bench = multiprocessing.parent_process()
    if bench is not None and os.getppid() != bench.pid:  # it died while this one imported: no signal will come
        os._exit(0)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as tierckpt run sets it
    ours: _Ours | None = None
    torch_: _Torch | None = None
    lock = threading.Lock()
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the bench is gone (died before the prctl above took effect): so are we
            os._exit(0)
        op = msg[0]
        if op == "ours":
            ours = _Ours(port, msg[1], msg[2], msg[3], connect_lock)
            conn.send("ready")
        elif op == "start":
            if ours is None:
                raise BenchError("ours has no figure")
            ours.start()
            conn.send("started")
        elif op == "count":
            if ours is None:
                raise BenchError("ours has no figure")
            _answer(conn, lock, ours.count)
        elif op == "generation":  # answers when it ends; "count" is answered meanwhile
            if ours is None:
                raise BenchError("ours has no figure")
            threading.Thread(target=_answer, args=(conn, lock, ours.generation, msg[1], msg[2]), daemon=True).start()
        elif op == "torch":
            torch_ = _Torch(port, msg[1], msg[2], msg[3], connect_lock)
            conn.send("ready")
        elif op == "first":
            if torch_ is None:
                raise BenchError("torch has no figure")
            conn.send({"ops": torch_.ops.value, "done": torch_.rendezvous()})
        elif op == "kill":
            if torch_ is None:
                raise BenchError("torch has no figure")
            torch_.kill(msg[1])
            conn.send("killed")
        elif op == "again":
            if torch_ is None:
                raise BenchError("torch has no figure")
            before = torch_.ops.value
            conn.send({"done": torch_.rendezvous(), "ops": torch_.ops.value - before})
        elif op == "exit":
            if ours is not None:
                ours.close()
            conn.send("bye")
            return
