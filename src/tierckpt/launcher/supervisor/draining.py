"""This node's side of a drain: its health monitor (detect/healthwatch.py), its mark in the job
store while unhealthy (membership/avoid.py ``mark_unhealthy``: the next restart keeps it out, a
full job restart avoids it), and the ``Drain`` claim it makes at a step boundary when a spare
waits (decide/drain.py). A drain is no fault: every node stops its workers, none counts a restart
(membership/change.py ``restart_history``), no offense is attributed, and the drained node stands
aside at the spare gate behind every other spare while the spare takes its rank in the next round
(the repeat offenders' path: ``Rounds.keep_out``, ``recovery.after_stop`` → ``STAND_ASIDE``).

Call order (the supervisor, loop.py):

    drainer = Drainer(opts, events, identity=..., replicated=...)   # once; builds and owns the HealthWatch
    drainer.start(generation)          # before the first round: the ``health`` event lists the checks
    each poll, before local detection: claim = drainer.poll(store, generation=g, node=n, record=...)
        a claim (reason ``Drain``) goes to the store like a fault's; every node's ``_recover`` reports
        it with ``drained(...)`` instead of a ``fault`` event
    drainer.close()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tierckpt import layout
from tierckpt.config import DEFAULT_MEMORY_DIR
from tierckpt.launcher.control.store import store_errors
from tierckpt.launcher.decide.drain import DrainPolicy, DrainStep
from tierckpt.launcher.detect.health import build_checks
from tierckpt.launcher.detect.healthwatch import HealthWatch
from tierckpt.launcher.events import Events
from tierckpt.launcher.membership.avoid import KeepOut, clear_unhealthy, mark_unhealthy, unhealthy_nodes
from tierckpt.launcher.membership.change import DRAIN
from tierckpt.launcher.membership.spares import spares_waiting
from tierckpt.launcher.options import RunOptions

__all__ = ["Drainer", "newest_boundary"]

#: how often an unhealthy node asks the store how many spares wait (two store operations)
SPARES_EVERY_S = 1.0


def newest_boundary(memory_dir: str, namespace: str | None, replicated: Mapping[str, int] | None) -> int | None:
    """The newest step every one of this node's namespaces has committed in its memory tier (and,
    with ``replicated``, the node agent's ``{namespace: step}`` sent to a replica target: the
    spare loads the drained node's ranks from there); None when there is none. ``namespace`` also
    covers local mode's ``<ns>--rank<k>``."""
    root = Path(memory_dir)
    try:
        names = [d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")]
    except OSError:
        return None
    if namespace:
        names = [n for n in names if n == namespace or n.startswith(f"{namespace}--rank")]
    newest: list[int] = []
    for name in names:
        try:
            steps = [s for d in (root / name).iterdir() if (s := layout.parse_step_dir(d.name)) is not None
                     and (d / layout.MARKER).exists()]
        except OSError:
            continue
        if not steps:
            continue
        step = max(steps)
        if replicated is not None:
            sent = replicated.get(name)
            if sent is None:
                return None
            step = min(step, int(sent))
        newest.append(step)
    return min(newest) if newest else None


class Drainer:
    """See the module doc for the call order."""

    def __init__(self, opts: RunOptions, events: Events, *, identity: str,
                 replicated: Callable[[], Mapping[str, int] | None]) -> None:
        cfg = opts.health
        self.events = events
        self.identity = identity
        self.policy = DrainPolicy(wait_s=cfg.drain_wait_s)
        self._memory_dir = opts.memory_dir or DEFAULT_MEMORY_DIR
        self._namespace = opts.namespace
        self._replicated = replicated
        self._generation = 0
        self.watch = HealthWatch(build_checks(cfg), events, interval_s=cfg.interval_s, fail_after=cfg.fail_after,
                                 generation=lambda: self._generation)
        self._marked = False  # this node's mark is in the store
        self._reported = False  # the unhealthy-with-no-spare warning of this episode was written
        self._waiting: tuple[float, int | None] | None = None  # (since, boundary then) once a spare waits
        self._spares = 0
        self._spares_at = 0.0

    def start(self, generation: int) -> None:
        self._generation = generation
        self.watch.start()

    def boundary(self) -> int | None:
        return newest_boundary(self._memory_dir, self._namespace, self._replicated())

    def poll(self, store: Any, *, generation: int, node: int,
             record: Callable[[str, str], dict[str, Any]]) -> dict[str, Any] | None:
        """The ``Drain`` claim to make now, or None. ``record(reason, detail)``: a claim's fields
        (findings.Findings.record) for this node."""
        self._generation = generation
        verdict = self.watch.verdict()
        now = time.monotonic()
        try:
            if verdict.healthy:
                if self._marked:
                    clear_unhealthy(store, self.identity)
                self._marked = self._reported = False
                self._waiting = None
                return None
            if not self._marked:
                mark_unhealthy(store, self.identity, verdict.detail, time.time())
                self._marked = True
            if now >= self._spares_at:
                self._spares, self._spares_at = spares_waiting(store), now + SPARES_EVERY_S
        except store_errors():
            return None  # the store's host is gone: liveness reports it
        waiting = self._waiting
        boundary = self.boundary() if waiting is not None else None
        step, why = self.policy.next_step(healthy=False, spares=self._spares,
                                          waiting_since=None if waiting is None else waiting[0],
                                          boundary_then=None if waiting is None else waiting[1],
                                          boundary_now=boundary, now=now)
        if step is DrainStep.REPORT:
            self._waiting = None
            if not self._reported:
                self._reported = True
                self.events.emit("warning", generation=generation, what=f"node {node} is unhealthy "
                                 f"({verdict.detail}); {why}: it keeps training, the next restart keeps it out "
                                 "where a spare can take its rank, and a full job restart avoids it")
            return None
        if step is DrainStep.WAIT:
            if waiting is None:
                self._waiting = (now, self.boundary())
                self.events.emit("drain", generation=generation, node=node, identity=self.identity, state="waiting",
                                 checks=verdict.checks, detail=verdict.detail, step=self._waiting[1], why=why)
            return None
        rec = record(DRAIN, verdict.detail)
        rec.update(identity=self.identity, checks=verdict.checks, boundary=boundary, why=why)
        self._waiting = None
        return rec

    def drained(self, claim: Mapping[str, Any], out: KeepOut, *, generation: int, store: Any) -> None:
        """On every node after the keep-out was agreed: a ``drain`` event per unhealthy node kept
        out (``state: "left"``: a spare takes its rank), and for a ``Drain`` claim whose node stays
        (the spare left meanwhile) one with ``state: "stayed"``."""
        try:
            sick = unhealthy_nodes(store)
        except store_errors():
            sick = {}
        for rank, ident in zip(out.ranks, out.identities, strict=True):
            if ident in out.unhealthy:
                mine = claim.get("reason") == DRAIN and claim.get("identity") == ident
                self.events.emit("drain", generation=generation, node=rank, identity=ident, state="left",
                                 to="spare", detail=(sick.get(ident) or {}).get("detail"),
                                 step=claim.get("boundary") if mine else None,
                                 at="step boundary" if mine else f"restart after {claim.get('reason')}",
                                 why=claim.get("why") if mine else "unhealthy; a spare takes its rank")
        if claim.get("reason") == DRAIN and claim.get("identity") not in out.unhealthy:
            self.events.emit("drain", generation=generation, node=claim.get("node"), identity=claim.get("identity"),
                             state="stayed", detail=claim.get("detail"),
                             why="no spare waits any more: the node stays until one does")

    def close(self) -> None:
        self.watch.close()
