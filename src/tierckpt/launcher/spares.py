"""Hot spares: an agent that arrives while the job already runs on its maximum of nodes.

torch's c10d rendezvous handler (torch >= 2.3; read in 2.13's ``dynamic_rendezvous.py``) puts
a node that arrives at a complete round whose participants already number ``max_nodes`` in the
round's *redundancy list*: it keeps its keep-alive beat and re-reads the state about once a
second, and it is not counted by ``num_nodes_waiting()`` (only the wait list is), so the running
agents see no membership change and do not restart. When a participant's keep-alive expires
(a lost node), the round has fewer than ``max_nodes`` participants: the spare leaves the
redundancy list for the wait list and joins the survivors' next round, where ``ranks.assign``
gives it the free rank, the lost node's (the survivors keep theirs). Its standby interpreters
were started before it entered the rendezvous, so its workers start warm, and they resume the
lost rank's newest step from the peer replica (``--replicas``).

Call order (the agent's ``_join``, around torch's blocking ``next_rendezvous``):

    with SpareWatch(handler, on_standby=lambda job_nodes: ...) as watch:
        handler.next_rendezvous()
    watch.since        # when this agent began standing by as a spare (None: it never did)
    report_round(events, generation, change, node=..., spare_since=watch.since)   # after the round
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from tierckpt.launcher.membership import Change

__all__ = ["SpareWatch", "report_round", "standing_by"]


def standing_by(handler: Any) -> int | None:
    """The number of nodes the running round has, if this agent waits in its redundancy list
    (a spare); None otherwise or when torch's private state cannot be read (``getattr`` with
    fallbacks, as ``rdzvwait.joined``)."""
    holder = getattr(handler, "_state_holder", None)
    state = getattr(holder, "state", None) if holder is not None else None
    node = getattr(handler, "_this_node", None)
    redundant = getattr(state, "redundancy_list", None)
    participants = getattr(state, "participants", None)
    if node is None or not isinstance(redundant, set) or not isinstance(participants, dict):
        return None
    try:
        return len(participants) if node in redundant else None
    except TypeError:  # an unhashable descriptor in some future torch
        return None


class SpareWatch:
    """Watches torch's rendezvous state while a round blocks; calls ``on_standby(job_nodes)`` once,
    from its own thread, when this agent is first found in the redundancy list."""

    def __init__(self, handler: Any, on_standby: Callable[[int], None], *, every_s: float = 0.25) -> None:
        self.handler = handler
        self.on_standby = on_standby
        self.every_s = every_s
        self.since: float | None = None  # time.time() when first seen standing by
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._done.wait(self.every_s):
            nodes = standing_by(self.handler)
            if nodes is not None:
                self.since = time.time()
                try:
                    self.on_standby(nodes)
                except Exception:  # noqa: BLE001 - a report must not break the rendezvous
                    pass
                return

    def __enter__(self) -> SpareWatch:
        self._thread = threading.Thread(target=self._run, name="tierckpt-spare-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)


def report_round(events: Any, generation: int, change: Change, *, node: int, spare_since: float | None) -> None:
    """The events of a settled round: ``spare`` with ``state: "joined"`` on a spare that took a
    rank (``node``, ``replaced``: the identity of the node that held it, ``standby_s``), and
    ``membership`` (``Change.to_event``) on every agent when the membership changed."""
    if spare_since is not None:
        events.emit("spare", generation=generation, state="joined", node=node,
                    replaced=change.before.get(node) if change.before.get(node) in change.left else None,
                    standby_s=round(time.time() - spare_since, 3))
    if change:
        events.emit("membership", generation=generation, **change.to_event())
