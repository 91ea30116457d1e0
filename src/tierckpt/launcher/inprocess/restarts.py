"""The agent's side of ``tierckpt.resilient``: which faults restart in-process, the request to
the workers and the ``restart`` events of ``kind="inprocess"``.

Call order (the agent, one per node, every monitor interval):
  1. ``arm(beat_dir, local_ranks)`` after each process start: the workers of this process
     generation write ``inproc_<local rank>.jsonl`` there (``ready``, then one ``restart`` per
     in-process restart) and watch ``inproc_request``.
  2. ``poll()``: the workers' new records; a restart the workers started themselves (an
     exception, a non-finite loss) becomes a ``fault`` and a ``restart`` event; True when the
     agent should re-arm its heartbeat trackers (the steps went back, the step paused).
  3. On a fault the agent claimed: ``handles(fault, node)`` (``replace.route`` says in-process:
     every local worker runs under the wrapper and all local processes live: a hang, a
     non-finite loss, a log rule, another node's worker replaced alone); then
     ``restart(generation)`` bumps the request counter (not for a replacement: the store's
     fault key tells the workers) and waits until every local worker reports the restart; None
     (timeout) sends the agent down the process-restart path. ``replaceable`` (every local
     worker ready on the agent-hosted store, budget left) lets a local crash be replaced alone.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from tierckpt import layout, workerenv
from tierckpt.launcher.events import Events
from tierckpt.launcher.inprocess.replace import REPLACE, Route, route

__all__ = ["InProcessRestarts"]

_REPLACE_TIMEOUT_S = 60.0  # a replacement starts (cold, perhaps) and joins: the wrapper's rejoin timeout


class InProcessRestarts:
    """Per node: the in-process restarts of the current process generation."""

    def __init__(self, events: Events, *, max_restarts: int = 10, timeout_s: float = 30.0) -> None:
        self.events = events
        self.max_restarts = max_restarts
        self.timeout_s = timeout_s
        self._dir: str | None = None
        self._ranks: list[int] = []
        self._offsets: dict[int, int] = {}
        self._ready: set[int] = set()
        self._agent_store: set[int] = set()  # local ranks whose wrapper uses the agent-hosted store
        self._done: dict[int, set[int]] = {}  # in-process generation k -> local ranks that reported it
        self._records: dict[int, list[dict[str, Any]]] = {}  # k -> the workers' restart records
        self._seen: set[int] = set()  # generations already turned into events
        self._requests = 0

    def arm(self, beat_dir: str, local_ranks: list[int]) -> None:
        self._dir, self._ranks = beat_dir, sorted(local_ranks)
        self._offsets, self._ready, self._done, self._seen, self._requests = {}, set(), {}, set(), 0
        self._records, self._agent_store = {}, set()

    @property
    def wrapped(self) -> bool:
        """Every local worker of this process generation reported ``ready`` under the wrapper."""
        return bool(self._ranks) and self._ready == set(self._ranks)

    @property
    def budget_left(self) -> bool:
        return self._requests < self.max_restarts and max(self._done, default=0) < self.max_restarts

    @property
    def replaceable(self) -> bool:
        """A local worker that dies can be replaced alone: all wrapped, on the agent-hosted store."""
        self._read()
        return self.wrapped and self._agent_store == set(self._ranks) and self.budget_left

    def handles(self, fault: dict[str, Any], node: int | None = None) -> bool:
        """Whether this node's workers restart in-process for ``fault`` (``replace.route``)."""
        self._read()
        return route(fault, node=node, wrapped=self.wrapped, budget_left=self.budget_left) == Route.INPROCESS

    def poll(self, generation: int, node_of: Callable[[int], int | None] | None = None) -> bool:
        """Events for restarts the workers began themselves; True when the trackers need re-arming.
        ``node_of``: the node that runs a global rank (the ``fault`` event names the culprit's node)."""
        self._read()
        rearm = False
        for k in sorted(self._done):
            # a generation a replacement joined belongs to the claim's restart (``restart``), however early it ends
            if k in self._seen or self._done[k] != set(self._ranks) or self._replaced(k):
                continue
            self._seen.add(k)
            rearm = True
            first = min(self._records[k], key=lambda r: float(r["fault_time"]))
            culprit = first.get("fault_rank", first.get("rank"))
            node = node_of(int(culprit)) if node_of is not None and isinstance(culprit, int) else None
            self.events.emit("fault", generation=generation, reason=first["reason"], rank=culprit,
                             detail=first.get("error"), inprocess=k, **({"node": node} if node is not None else {}))
            self.events.emit("restart", generation=generation, kind="inprocess", reason=first["reason"],
                             inprocess=k, stages_s=first.get("stages_s"),
                             recovery_s=round(time.time() - first["fault_time"], 3))
        return rearm

    def restart(self, generation: int, reason: str | None, *, kind: str = "inprocess", since: float | None = None,
                abandon: Callable[[], list[int]] | None = None, **detail: Any) -> float | None:
        """Ask this node's workers to restart in-process (``kind="replace"``: a replacement joins
        them, the store's fault key is their request); seconds from ``since`` (default: now) until
        all reported it, None on timeout, or as soon as ``abandon()`` names a node counted lost (a
        rank waits in a collective for a rank of that node, which never rejoins: the process
        path's rendezvous replaces it). ``detail`` goes into the ``restart`` event."""
        if self._dir is None:
            return None
        t0 = time.time() if since is None else since
        self._read()
        pending = [k for k in self._done if k not in self._seen and self._replaced(k)]
        want = min(pending) if kind == REPLACE and pending else max(self._done, default=0) + 1
        self._requests += 1
        if kind != REPLACE:
            layout.write_atomic(os.path.join(self._dir, workerenv.INPROC_REQUEST), str(self._requests))
        deadline = time.monotonic() + (self.timeout_s if kind != REPLACE else max(self.timeout_s, _REPLACE_TIMEOUT_S))
        while self._done.get(want) != set(self._ranks):
            if time.monotonic() > deadline or (abandon is not None and abandon()):
                return None
            time.sleep(0.01)
            self._read()
        self._seen.add(want)
        recovery = max(0.0, time.time() - t0)
        stages = [r.get("stages_s") for r in self._records.get(want, []) if r.get("joined")]
        self.events.emit("restart", generation=generation, kind=kind, reason=reason, inprocess=want,
                         recovery_s=round(recovery, 3), **({"join_stages_s": stages[0]} if stages else {}), **detail)
        return recovery

    def _replaced(self, k: int) -> bool:
        """In-process generation k began because a replacement joined for a dead rank."""
        return any(r.get("replaced") for r in self._records.get(k, []))

    def _read(self) -> None:
        if self._dir is None:
            return
        for lr in self._ranks:
            path = os.path.join(self._dir, workerenv.inproc_report(lr))
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets.get(lr, 0))
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
            self._offsets[lr] = self._offsets.get(lr, 0) + end
            for line in data[:end].splitlines():
                rec = json.loads(line)
                if rec.get("event") == "ready":
                    self._ready.add(lr)
                    if rec.get("store") == "agent":
                        self._agent_store.add(lr)
                elif rec.get("event") == "restart":
                    self._done.setdefault(int(rec["k"]), set()).add(lr)
                    self._records.setdefault(int(rec["k"]), []).append(rec)
