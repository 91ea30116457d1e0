"""Liveness with one watcher (launcher/control/liveness.py): the pure parts on a fake clock, then simulated
agents in threads against a real TCPStore on 127.0.0.1, counting every store operation."""

from __future__ import annotations

import datetime
import gc
import json
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from tierckpt.launcher.control.liveness import Liveness, Silence, StoreSilence, Verdict
from tierckpt.launcher.control.store import connect_client
from tierckpt.testing.storecount import Counter, CountingStore


def _server() -> dist.TCPStore:  # type: ignore[name-defined]
    # use_libuv=False: the libuv server accepts a client every ~150 ms on this box (64 clients: 10 s)
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,  # type: ignore[attr-defined]
                         timeout=datetime.timedelta(seconds=10), use_libuv=False)


def _until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_silence_reports_counters_that_stop_moving() -> None:
    s = Silence([1, 2], timeout_s=1.0, now=0.0)
    s.observe(1, b"1", 0.5)
    s.observe(2, b"1", 0.5)
    s.observe(1, b"2", 1.2)
    assert s.silent(1.6) == [2] and s.silent(1.4) == []
    s.observe(3, b"9", 1.0)  # not watched: ignored
    assert s.nodes == [1, 2]


def test_a_stale_verdict_names_its_watcher_lost_and_the_next_rank_takes_over() -> None:
    v = Verdict([0, 1, 2, 3], timeout_s=1.0, since=0.0)
    assert v.known_lost(9.0) == []  # never read yet: nobody is suspected
    v.started = True
    assert v.designated(0.5) == 0 and v.known_lost(0.5) == []
    assert v.known_lost(1.5) == [0] and v.designated(1.5) == 1  # rank 0 never published
    v.read(json.dumps({"seq": 1, "watcher": 0, "lost": [3]}).encode(), 2.0)
    assert v.designated(2.5) == 0 and v.known_lost(2.5) == [3]
    v.read(json.dumps({"seq": 1, "watcher": 0, "lost": [3]}).encode(), 2.8)  # unchanged: still stale at 3.1
    assert v.known_lost(3.1) == [0, 3] and v.designated(3.1) == 1


def test_a_gap_in_the_reads_longer_than_the_timeout_starts_silence_over() -> None:
    s = Silence([1, 2], timeout_s=1.0, now=0.0)
    s.read(0.5)
    s.observe(1, b"1", 0.5)
    s.observe(2, b"1", 0.5)
    s.read(4.0)  # the reader stalled 3.5 s: counters unchanged across it are no evidence
    s.observe(1, b"1", 4.0)
    s.observe(2, b"2", 4.0)
    assert s.silent(4.0) == [] and s.silent(4.9) == []
    for t in (4.6, 5.1):  # regular reads again: node 1 really stopped
        s.read(t)
        s.observe(1, b"1", t)
        s.observe(2, str(t).encode(), t)
    assert s.silent(5.1) == [1]
    v = Verdict([0, 1], timeout_s=1.0, since=0.0, started=True)
    v.read(b'{"seq": 1, "watcher": 0, "lost": []}', 0.2)
    v.read(b'{"seq": 1, "watcher": 0, "lost": []}', 3.0)  # the same verdict, after a 2.8 s gap in the reads
    assert v.known_lost(3.0) == [] and v.designated(3.0) == 0
    v.read(b'{"seq": 1, "watcher": 0, "lost": []}', 3.6)
    v.read(b'{"seq": 1, "watcher": 0, "lost": []}', 4.1)  # unchanged for 1.1 s of regular reads
    assert v.known_lost(4.1) == [0] and v.designated(4.1) == 1


def test_quiet_lists_counters_silent_for_a_second_of_regular_reads() -> None:
    s = Silence([1, 2], timeout_s=10.0, now=0.0, regular_s=1.5)
    for t in (0.5, 1.0, 1.5, 2.0, 2.5):
        s.read(t)
        s.observe(1, b"1", t)  # node 1 stopped beating at 0.5 (its first value)
        s.observe(2, str(t).encode(), t)
    assert s.quiet(2.5, 1.0) == {1: 2.0} and s.quiet(2.5, 2.1) == {} and s.silent(2.5) == []
    s.read(4.5)  # the reader stalled 2 s: what it missed is no evidence, the quiet span starts over
    s.observe(1, b"1", 4.5)
    s.observe(2, b"x", 4.5)
    assert s.quiet(4.5, 0.1) == {}
    s.read(5.0)
    s.observe(1, b"1", 5.0)
    s.observe(2, b"y", 5.0)
    assert s.quiet(5.6, 1.0) == {1: 1.1}  # 1.1 s since the reads became regular again
    v = Verdict([0, 1, 2], timeout_s=10.0, since=0.0, started=True)
    v.read(json.dumps({"seq": 3, "watcher": 0, "lost": [], "quiet": {"2": 1.6}}).encode(), 1.0)
    assert v.published_quiet == {2: 1.6}
    v.read(json.dumps({"seq": 4, "watcher": 0, "lost": []}).encode(), 1.5)  # an older agent's verdict
    assert v.published_quiet == {}


def test_a_silent_agent_is_quiet_on_every_agent_within_two_intervals_of_a_second() -> None:
    store = _server()
    agents = _Agents(store.port, 3, interval_s=0.05, timeout_s=5.0)
    a0, a1, a2 = agents.agents
    try:
        assert _until(lambda: all(a.ticks >= 3 for a in agents.agents))
        assert all(a.quiet() == {} for a in agents.agents)
        a2.close()
        t = time.monotonic()
        assert _until(lambda: 2 in a0.quiet() and 2 in a1.quiet())
        assert time.monotonic() - t < 4.0 and a1.lost() == [] and a1.quiet()[2] >= 1.0
        assert 0 not in a1.quiet() and 1 not in a0.quiet()
    finally:
        agents.close()


class _Agents:
    """``n`` Liveness threads, each with its own counted client of one real TCPStore."""

    def __init__(self, port: int, n: int, *, interval_s: float, timeout_s: float) -> None:
        self.counters = [Counter() for _ in range(n)]
        # connected one after the other: many clients connecting at once stall for seconds here
        clients = [CountingStore(connect_client("127.0.0.1", port), c) for c in self.counters]
        self.agents = [Liveness(lambda c=c: c, i, interval_s=interval_s, timeout_s=timeout_s)  # type: ignore[misc]
                       for i, c in enumerate(clients)]
        for a in self.agents:
            a.reset(a.node, list(range(n)), epoch=7)
            a.start()

    def close(self) -> None:
        for a in self.agents:
            a.close()


def test_store_operations_per_interval_grow_linearly_with_the_agents() -> None:
    per_agent_tick = {}
    for n in (8, 32):
        store = _server()
        agents = _Agents(store.port, n, interval_s=0.05, timeout_s=5.0)
        try:
            assert _until(lambda live=agents.agents: all(a.ticks >= 5 for a in live))  # type: ignore[misc]
            ops0 = [c.value for c in agents.counters]
            ticks0 = [a.ticks for a in agents.agents]
            time.sleep(1.0)
            ops = [c.value - o for c, o in zip(agents.counters, ops0, strict=True)]
            ticks = [a.ticks - t for a, t in zip(agents.agents, ticks0, strict=True)]
            assert [a.watching for a in agents.agents] == [True] + [False] * (n - 1), n
            assert all(a.lost() == [] for a in agents.agents)
        finally:
            agents.close()
        # every agent but the watcher: exactly 2 operations a tick (its beat, the verdict)
        for o, t in zip(ops[1:], ticks[1:], strict=True):
            assert abs(o - 2 * t) <= 2, (n, o, t)
        # the watcher: 2 more a tick (one multi_get of every beat, one set), whatever n is
        assert ops[0] <= 4 * ticks[0] + 4, (n, ops[0], ticks[0])
        per_agent_tick[n] = sum(ops) / sum(ticks)
    # all-to-all reads would make this grow 4x from 8 to 32 agents; here it stays flat
    assert per_agent_tick[32] <= per_agent_tick[8] * 1.2, per_agent_tick


def test_the_watcher_dies_and_the_next_rank_takes_over() -> None:
    store = _server()
    agents = _Agents(store.port, 4, interval_s=0.05, timeout_s=0.6)
    a0, a1, a2, a3 = agents.agents
    try:
        assert _until(lambda: all(a.ticks >= 3 for a in agents.agents))
        assert a0.watching and all(a.lost() == [] for a in agents.agents)
        a0.close()  # the watcher's agent goes silent; the store (elsewhere) stays
        assert _until(lambda: all(a.lost() == [0] for a in (a1, a2, a3)))
        assert _until(lambda: a1.watching and not a2.watching and not a3.watching)
        time.sleep(0.3)
        assert [a.lost() for a in (a1, a2, a3)] == [[0]] * 3  # nobody else is suspected
        a3.close()  # a second loss is found by the new watcher
        assert _until(lambda: a1.lost() == [0, 3] and a2.lost() == [0, 3])
    finally:
        agents.close()


def test_a_store_that_goes_away_is_a_store_error() -> None:
    store = _server()
    agents = _Agents(store.port, 2, interval_s=0.05, timeout_s=0.3)
    try:
        assert _until(lambda: all(a.ticks >= 3 for a in agents.agents))
        del store
        gc.collect()
        assert _until(lambda: all(a.store_error is not None for a in agents.agents))
    finally:
        agents.close()


def test_a_new_epoch_does_not_read_the_old_verdict() -> None:
    store = _server()
    store.set("tierckpt/run/live/6/verdict", json.dumps({"seq": 9, "watcher": 1, "lost": [0]}).encode())
    agents = _Agents(store.port, 2, interval_s=0.05, timeout_s=5.0)  # epoch 7
    try:
        assert _until(lambda: all(a.ticks >= 5 for a in agents.agents))
        assert all(a.lost() == [] for a in agents.agents) and agents.agents[0].watching
    finally:
        agents.close()


def test_stop_barrier_and_regroup_cost_a_few_operations_per_agent_whatever_the_wait() -> None:
    import threading

    from tierckpt.launcher.control.jobcontrol import JobControl

    store = _server()
    n = 16
    counters = [Counter() for _ in range(n)]
    ctls = [JobControl(CountingStore(connect_client("127.0.0.1", store.port), c)) for c in counters]
    out: dict[int, tuple[bool, tuple[int, int] | None]] = {}

    def agent(i: int) -> None:
        time.sleep(0.01 * i)  # arrivals spread over 0.15 s: a poller would pay for every wait
        ctls[i].stopped(3)
        ok = ctls[i].wait_stopped(3, n, timeout=10)
        survivors = [x for x in range(n) if x != 5]
        out[i] = (ok, ctls[i].regroup(3, i, survivors, timeout=10) if i != 5 else None)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(out[i][0] for i in range(n))
    assert [out[i][1] for i in range(n) if i != 5] == [(r, n - 1) for r in range(n - 1)]
    assert max(c.value for c in counters) <= 8, [c.value for c in counters]  # add, add, wait, set; twice
    assert ctls[0].regroup(4, 0, [0, 1], timeout=0.2) is None  # node 1 never comes
    # a node the verdict counted lost (still running) is no survivor: no rank, and the count is untouched
    assert ctls[5].regroup(5, 5, [0, 1], timeout=0.2) is None
    assert ctls[0].store.add("tierckpt/run/regroup/5", 0) == 0


class _Paused:
    """A real store client whose calls wait while ``paused`` is clear: the agent's liveness thread
    stalls (starved of CPU, or its process stopped), its store and every other agent go on."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.running = threading.Event()
        self.running.set()

    def __getattr__(self, name: str) -> object:
        fn = getattr(self.inner, name)

        def call(*args: object, **kw: object) -> object:
            self.running.wait()
            return fn(*args, **kw)
        return call


def test_an_agent_whose_own_thread_stalls_suspects_nobody() -> None:
    """Silence is what a read saw, never the clock alone: a watcher whose thread stalled for 4x the
    timeout does not call every peer lost, nor does an agent that could not read the verdict call
    the watcher lost (found by ``bench scale`` at 1024 simulated agents on 2 cores: starved agents
    claimed the live watcher, node 0, lost). A peer that really went silent is still found."""
    store = _server()
    clients = [_Paused(connect_client("127.0.0.1", store.port)) for _ in range(3)]
    agents = [Liveness(lambda c=c: c, i, interval_s=0.05, timeout_s=0.5)  # type: ignore[misc]
              for i, c in enumerate(clients)]
    for a in agents:
        a.reset(a.node, [0, 1, 2], epoch=1)
        a.start()
    try:
        assert _until(lambda: all(a.ticks >= 5 for a in agents))
        assert agents[0].watching
        clients[1].running.clear()  # agent 1's liveness thread stalls (so its beat stops),
        clients[0].running.clear()  # and so does the watcher's
        time.sleep(2.0)  # 4x the timeout without a read
        assert agents[1].lost() == [], "a stalled agent called the watcher lost"
        assert agents[0].lost() == [], "a stalled watcher called its peers lost"
        clients[0].running.set()
        clients[1].running.set()
        time.sleep(0.3)
        assert [a.lost() for a in agents] == [[], [], []]
        agents[2].close()  # a real silence: the watcher finds it after the timeout
        assert _until(lambda: agents[0].lost() == [2] and agents[1].lost() == [2])
    finally:
        for c in clients:
            c.running.set()
        for a in agents:
            a.close()


class _Blackholed:
    """A real store client that, once ``cut``, behaves as one whose store host drops every packet:
    each call blocks for the client's timeout (``block_s``), then fails as torch's client does."""

    def __init__(self, inner: object, block_s: float) -> None:
        self.inner, self.block_s = inner, block_s
        self.cut = threading.Event()

    def __getattr__(self, name: str) -> object:
        fn = getattr(self.inner, name)

        def call(*args: object, **kw: object) -> object:
            if self.cut.is_set():
                time.sleep(self.block_s)
                raise dist.DistStoreError(f"{name}: timed out after {self.block_s}s (the store's host drops packets)")  # type: ignore[attr-defined]
            return fn(*args, **kw)
        return call


def test_a_store_whose_host_drops_packets_is_lost_after_the_timeout_once() -> None:
    """Each call to a blackholed store blocks for the client's timeout: the loss is judged by the
    time since the last call that succeeded, not by a count of failures times the interval (which
    took 13 blocked calls here, and 20 of torch's 30 s ones on namespaced hosts: 10 minutes), and
    ``on_store_lost`` is called once, from the liveness thread."""
    store = _server()
    client = _Blackholed(connect_client("127.0.0.1", store.port), block_s=0.2)
    calls: list[tuple[float, str]] = []
    live = Liveness(lambda: client, 0, interval_s=0.05, timeout_s=0.6,
                    on_store_lost=lambda why: calls.append((time.monotonic(), why)))
    live.reset(0, [0, 1], epoch=1)
    live.start()
    try:
        assert _until(lambda: live.ticks >= 3)
        cut = time.monotonic()
        client.cut.set()
        assert _until(lambda: live.store_error is not None, timeout=5.0)
        assert 0.6 - 0.05 <= calls[0][0] - cut <= 0.6 + 0.05 + 2 * 0.2 + 0.3, calls[0][0] - cut
        time.sleep(0.6)
        assert len(calls) == 1, calls  # whichever saw it first: the watchdog, or the failed call's handler
        assert "drops packets" in calls[0][1] or "no call to the job store succeeded" in calls[0][1], calls
    finally:
        live.close()


def test_store_silence_counts_only_the_time_its_watchdog_watched() -> None:
    s = StoreSilence(10.0, now=0.0, regular_s=2.5)
    for t in range(1, 11):  # a check each second, no call succeeded since 0
        assert not s.check(float(t))
    assert s.check(10.5) and s.silent_s(10.5) == 10.5
    s = StoreSilence(10.0, now=0.0, regular_s=2.5)
    s.check(1.0)
    assert not s.check(20.0)  # this process was stopped for 19 s: the silence starts over at 20
    for t in range(21, 31):
        assert not s.check(float(t))
    assert s.check(30.5)
    s.ok(31.0)
    assert not s.check(32.0) and s.silent_s(32.0) == 1.0


def test_a_store_whose_calls_never_return_is_lost_by_the_watchdog() -> None:
    """torch's client blocks without end in a call nobody answers (the store's host gone, its
    packets dropped): the liveness thread sits in that call, and the watchdog beside it calls
    the store lost once nothing succeeded for the timeout (on namespaced hosts the survivor of
    the store's host hung for good: tests/cluster/test_store_host.py)."""
    store = _server()
    client = _Paused(connect_client("127.0.0.1", store.port))
    calls: list[float] = []
    live = Liveness(lambda: client, 0, interval_s=0.05, timeout_s=0.6,
                    on_store_lost=lambda why: calls.append(time.monotonic()))
    live.reset(0, [0, 1], epoch=1)
    live.start()
    try:
        assert _until(lambda: live.ticks >= 3)
        cut = time.monotonic()
        client.running.clear()  # every call from now on blocks
        assert _until(lambda: live.store_error is not None, timeout=5.0)
        # from the last call that succeeded (at most an interval before the cut), checked every 0.05 s
        assert 0.6 - 0.05 <= calls[0] - cut <= 0.6 + 0.05 + 0.3, calls[0] - cut
        assert "no call to the job store succeeded" in (live.store_error or "")
        time.sleep(0.3)
        assert len(calls) == 1
    finally:
        client.running.set()
        live.close()
