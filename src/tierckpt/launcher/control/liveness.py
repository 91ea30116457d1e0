"""Agent liveness with O(N) store traffic per interval: each agent beats one key, one watcher reads them all.

Keys (keys.py), under ``tierckpt/run/live/<epoch>/`` of the rendezvous store (``epoch``: the generation
agreed at the rendezvous round, so a verdict of an older membership is never read):

    beat/<node>   an agent's counter: ``add(1)`` once per interval, by that agent only
    verdict       the watcher's verdict, ``{"seq", "watcher", "lost", "quiet"}``: ``set`` once per
                  interval; ``quiet`` maps the nodes silent for ``QUIET_S`` (1 s) of regular reads to
                  their seconds of silence (the early sign a local symptom is weighed against,
                  decide/diagnose.py); ``lost`` lists those silent for ``timeout_s``

Call order, on every agent:

    live = Liveness(connect, node, interval_s=0.5, timeout_s=30,   # once; connect's client times
                    on_store_lost=callback)                       # out well within timeout_s
    live.start()                                # its thread: its own store client, see below
    live.reset(node, nodes, epoch=generation)   # after every rendezvous round
    live.lost()                                 # every monitor tick; no store operation
    live.quiet()                                # ... the nodes silent for a second or more, by seconds
    live.store_error                            # set when the store is unreachable for timeout_s
                                                # (no call succeeded for that long, as a watchdog thread
                                                # sees it: StoreSilence); on_store_lost(why) is called
                                                # once then, from that thread
    live.close()

Per interval, the thread of every agent makes two store operations (``add`` its beat; read the
verdict with one ``compare_set`` that never writes); the watcher makes two more (one
``multi_get`` of every beat, one ``set`` of the verdict): ``2N + 2`` operations in all where the
all-to-all scheme made ``N²``. The watcher is the lowest group rank not known lost. A verdict
that has not changed for ``timeout_s`` means its watcher is gone: every agent counts it lost,
and the lowest rank left takes over (watching from that moment, so a node that died with the
watcher is found one ``timeout_s`` later). When the store itself lives with the watcher, its
loss is ``store_error`` (LostStore) instead.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tierckpt.launcher.control import keys
from tierckpt.launcher.control.store import multi_get_parts, peek, store_errors

__all__ = ["QUIET_S", "Liveness", "Silence", "StoreSilence", "Verdict"]

#: an agent silent this long is listed in the verdict's ``quiet`` (its seconds of silence)
QUIET_S = 1.0


class Silence:
    """Which counters have not moved for ``timeout_s`` (pure; the caller passes the clock, the
    time of its reads: silence is what reads saw, never the clock alone).

    Call order, per read of every counter: ``read(now)``, then ``observe(node, value, now)`` for
    each; ``silent(now)`` with the time of the last read."""

    def __init__(self, nodes: Iterable[int], timeout_s: float, now: float, *, regular_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.regular_s = regular_s  # reads further apart than this: the reader stalled (``quiet`` starts over)
        self._last: dict[int, tuple[Any, float]] = {n: (None, now) for n in nodes}
        self.read_at = now
        self._steady = now  # reads have come at most ``regular_s`` apart since then

    def read(self, now: float) -> None:
        """A read of every counter begins. After a gap longer than ``timeout_s`` (this watcher's
        own thread stalled: a starved CPU, a stopped process) the reader knows nothing of that
        time, and every counter's silence starts over: a counter unchanged across the gap is not
        evidence, since its writer may have stalled with the reader."""
        if now - self.read_at > self.timeout_s:
            self._last = {n: (v, now) for n, (v, _) in self._last.items()}
        if self.regular_s is not None and now - self.read_at > self.regular_s:
            self._steady = now
        self.read_at = now

    def observe(self, node: int, value: Any, now: float) -> None:
        seen = self._last.get(node)
        if seen is not None and seen[0] != value:
            self._last[node] = (value, now)

    @property
    def nodes(self) -> list[int]:
        return sorted(self._last)

    def silent(self, now: float) -> list[int]:
        return sorted(n for n, (_, t) in self._last.items() if now - t > self.timeout_s)

    def quiet(self, now: float, at_least: float) -> dict[int, float]:
        """Counters unchanged for ``at_least`` seconds of regular reads, by seconds (the early sign of
        a lost node that ``diagnose`` weighs against a local symptom; ``silent`` is the verdict)."""
        out = {}
        for n, (_, t) in self._last.items():
            span = now - max(t, self._steady)
            if span >= at_least:
                out[n] = round(span, 3)
        return out


@dataclass
class Verdict:
    """An agent's reading of the verdict key (pure): who watches, who is lost, is it fresh."""

    nodes: list[int]
    timeout_s: float
    since: float  #: when the verdict last changed (the reset, before the first one)
    raw: bytes | None = None
    watcher: int | None = None
    published_lost: list[int] = field(default_factory=list)
    published_quiet: dict[int, float] = field(default_factory=dict)
    started: bool = False  #: read once (Liveness moves ``since`` to its first read)
    read_at: float | None = None  #: the last read (a gap longer than ``timeout_s`` starts over)

    def read(self, raw: bytes | None, now: float) -> None:
        if self.read_at is not None and now - self.read_at > self.timeout_s:
            self.since = now  # this agent read nothing for a whole timeout: an unchanged verdict says nothing
        self.read_at = now
        if raw is None or raw == self.raw:
            return
        self.raw, self.since = raw, now
        doc = json.loads(raw)
        self.watcher, self.published_lost = int(doc["watcher"]), [int(n) for n in doc["lost"]]
        self.published_quiet = {int(n): float(q) for n, q in (doc.get("quiet") or {}).items()}

    def stale(self, now: float) -> bool:
        return self.started and now - self.since > self.timeout_s

    def designated(self, now: float) -> int | None:
        """The watcher: the verdict's own while fresh, else the lowest rank not known lost."""
        if self.watcher is not None and not self.stale(now):
            return self.watcher
        out = set(self.known_lost(now))
        left = [n for n in self.nodes if n not in out]
        return min(left) if left else None

    def known_lost(self, now: float) -> list[int]:
        lost = set(self.published_lost)
        if self.stale(now):  # the watcher (or, before any verdict, the first one due) went silent
            lost.add(self.watcher if self.watcher is not None else min(self.nodes, default=-1))
        return sorted(n for n in lost if n in self.nodes)


class StoreSilence:
    """How long no call to the store has succeeded, as seen by a watchdog that kept running (pure;
    the caller passes the clock). torch's store client blocks without end in a call whose answer
    never comes (the store's host lost, its packets dropped; only ``set`` returns at once), so the
    thread making the call cannot judge; the watchdog does, and a gap in its own checks longer
    than ``regular_s`` (this process stopped or starved) starts the silence over: what was not
    watched is not counted.

    Call order: ``ok(now)`` after each call that succeeded; ``check(now)`` on each watchdog wake:
    True once the silence exceeds ``timeout_s``."""

    def __init__(self, timeout_s: float, now: float, *, regular_s: float) -> None:
        self.timeout_s, self.regular_s = timeout_s, regular_s
        self._since = now  # the last success, or the end of the last gap in the checks
        self._checked = now

    def ok(self, now: float) -> None:
        self._since = max(self._since, now)

    def silent_s(self, now: float) -> float:
        return now - self._since

    def check(self, now: float) -> bool:
        if now - self._checked > self.regular_s:  # the watchdog itself did not run: start over
            self._since = max(self._since, now)
        self._checked = now
        return now - self._since > self.timeout_s


class Liveness:
    """The liveness thread of one agent; see the module docstring for keys, call order and costs."""

    def __init__(self, connect: Callable[[], Any], node: int, *, interval_s: float, timeout_s: float,
                 on_store_lost: Callable[[str], None] | None = None) -> None:
        self._connect = connect
        self._on_store_lost = on_store_lost
        self.node = node
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._epoch = 0
        self._verdict = Verdict([], timeout_s, time.monotonic())
        self._watch: Silence | None = None  # while this agent is the watcher
        self._watch_since_lost: list[int] = []  # lost when this agent took over (the old watcher)
        self._seq = 0
        self._all_beat = False  # every beat key of this epoch exists (multi_get would block otherwise)
        self._read_at = time.monotonic()  # the last read of the verdict or of the beats (lost() judges at it)
        self.store_error: str | None = None
        self.ticks = 0  #: intervals completed (the bench and the tests count operations per tick)
        self._thread = threading.Thread(target=self._run, name="tierckpt-liveness", daemon=True)
        # the store's silence, judged beside the calls (which may block without end); see StoreSilence
        self._silence = StoreSilence(timeout_s, time.monotonic(), regular_s=max(1.0, timeout_s / 4))
        self._lost_once = threading.Lock()
        self._dog = threading.Thread(target=self._watchdog, name="tierckpt-store-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._dog.start()

    def reset(self, node: int, nodes: list[int], *, epoch: int = 0) -> None:
        """Watch a new membership (after a rendezvous round); ``epoch`` is the same on every agent."""
        with self._lock:
            self.node, self._epoch = node, epoch
            self._read_at = time.monotonic()
            self._verdict = Verdict(sorted(nodes), self.timeout_s, self._read_at)
            self._watch, self._watch_since_lost, self._all_beat = None, [], False

    def quiet(self) -> dict[int, float]:
        """Other group ranks whose agents have been silent for ``QUIET_S`` or more, by seconds of
        silence, as of the last verdict (the watcher's own reading when this agent watches); none
        while the verdict itself is stale."""
        with self._lock:
            now = self._read_at
            if self._watch is not None:
                quiet = self._watch.quiet(now, QUIET_S)
            else:
                quiet = {} if self._verdict.stale(now) else dict(self._verdict.published_quiet)
        return {n: s for n, s in quiet.items() if n != self.node}

    def lost(self) -> list[int]:
        """The other group ranks silent for longer than ``timeout_s``, as of this agent's last
        read: a thread that could not read (starved, stopped) suspects nobody meanwhile."""
        with self._lock:
            now = self._read_at
            lost = self._watch_lost(now) if self._watch is not None else self._verdict.known_lost(now)
        return [n for n in lost if n != self.node]

    @property
    def watching(self) -> bool:
        """This agent is the watcher now."""
        return self._watch is not None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._dog.join(timeout=5)

    def _store_lost(self, why: str) -> None:
        """Once: ``on_store_lost(why)`` (the supervisor ends the run there), then ``store_error``."""
        if not self._lost_once.acquire(blocking=False):
            return
        if self._on_store_lost is not None:  # first: the monitor loop reads store_error
            self._on_store_lost(why)
        self.store_error = why

    def _watchdog(self) -> None:
        step = min(self.interval_s, 0.5)
        while not self._stop.wait(step):
            with self._lock:
                lost = self._silence.check(time.monotonic())
                silent = self._silence.silent_s(time.monotonic())
            if lost:
                self._store_lost(f"no call to the job store succeeded for {silent:.1f}s (its host lost, or "
                                 "unreachable)")
                return

    def _watch_lost(self, now: float) -> list[int]:
        if self._watch is None:  # not the watcher: nothing of its own to report
            return sorted(self._watch_since_lost)
        return sorted(set(self._watch.silent(now)) | set(self._watch_since_lost))

    def _run(self) -> None:
        errors = store_errors()
        try:
            store = self._connect()
        except errors as exc:
            self._store_lost(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return
        with self._lock:
            self._silence.ok(time.monotonic())
        while not self._stop.wait(self.interval_s):
            try:
                self._tick(store)
                with self._lock:
                    self._silence.ok(time.monotonic())
                self.ticks += 1
            except errors as exc:  # a call that failed (refused, timed out): judged by the time since one succeeded
                with self._lock:
                    lost = self._silence.check(time.monotonic())
                if lost:
                    self._store_lost(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    def _tick(self, store: Any) -> None:
        with self._lock:
            epoch, node = self._epoch, self.node
        store.add(keys.beat(epoch, node), 1)
        raw = peek(store, keys.verdict(epoch))
        now = time.monotonic()
        with self._lock:
            if epoch != self._epoch:
                return  # a reset ran meanwhile: the next tick reads the new epoch
            v = self._verdict
            if not v.started:  # silence counts from this agent's first read, not from its reset
                v.since, v.started = now, True
            v.read(raw, now)
            self._read_at = now
            if v.designated(now) != node:
                self._watch = None
                return
            if self._watch is None:  # taking over (or first to watch): every peer starts now
                self._watch = Silence([n for n in v.nodes if n != node], self.timeout_s, now,
                                      regular_s=3 * self.interval_s)
                self._watch_since_lost = v.known_lost(now)
            peers = self._watch.nodes
        values = self._read_beats(store, epoch, peers)
        now = time.monotonic()
        with self._lock:
            if epoch != self._epoch or self._watch is None:
                return
            self._watch.read(now)
            self._read_at = now
            for n, value in values.items():
                self._watch.observe(n, value, now)
            self._seq += 1
            doc = json.dumps({"seq": self._seq, "watcher": node, "lost": self._watch_lost(now),
                              "quiet": self._watch.quiet(now, QUIET_S)}).encode()
        store.set(keys.verdict(epoch), doc)

    def _read_beats(self, store: Any, epoch: int, peers: list[int]) -> dict[int, bytes]:
        """Every peer's counter: one ``multi_get`` (``multi_get_parts``) once every beat key exists (it would block on a
        missing one), before that one non-blocking read per key."""
        beats = [keys.beat(epoch, n) for n in peers]
        if not beats:
            return {}
        if not self._all_beat and store.check(beats):
            self._all_beat = True
        if self._all_beat:
            return dict(zip(peers, multi_get_parts(store, beats), strict=True))
        got = {n: peek(store, k) for n, k in zip(peers, beats, strict=True)}
        return {n: v for n, v in got.items() if v is not None}
