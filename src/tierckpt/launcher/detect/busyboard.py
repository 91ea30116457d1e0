"""Which nodes have a rank that is silent but busy, on the rendezvous store: what the other ranks are doing.

    board = BusyBoard(store, node)               # the agent, after each rendezvous round
    board.exchange(generation, nnodes, busy, ask)  # each poll (procwatch.sample_ranks): publish
                                                 # this node's state (one write when it changes);
                                                 # when ``ask`` (a local rank is idle near its
                                                 # limit), whether another node has a busy rank

A rank that waits idle in a collective for a rank of another node which is computing (an
evaluation pass on rank 0 alone, a synchronous save) is not hung; hang.py's idle rule asks this
board before it fires. Keys (keys.busy, keys.wait): ``tierckpt/run/busy/<generation>/<node>`` = ``1`` or ``0``; a new
generation starts with none. ``waits`` does the same for where idle ranks wait
(``tierckpt/run/wait/<generation>/<node>``: ``<global rank>:<code>:<site>`` per idle rank, comma
separated; waitsample.py), so that hang.py names the rank stalled in its own code, not the ones
waiting for it in a collective, and the diagnosis names the rank that waits where the others do not. An agent that dies while its key says ``1`` is a lost node
(control.Liveness), so a stale ``1`` does not excuse a hang for longer than ``--node-timeout``
before the job restarts anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tierckpt.launcher.control import keys
from tierckpt.launcher.control.store import store_errors

__all__ = ["BusyBoard"]


class BusyBoard:
    """One node's view of the store keys above; a store error reads as "no one busy"."""

    def __init__(self, store: Any, node: int) -> None:
        self.store = store
        self.node = node
        self._last: dict[Callable[[int, int], str], tuple[int, bytes]] = {}  # per key: (generation, value) written last

    def exchange(self, generation: int, nnodes: int, busy: bool, ask: bool) -> bool:
        self.publish(generation, busy)
        return ask and nnodes > 1 and self.others_busy(generation, nnodes)

    def publish(self, generation: int, busy: bool) -> None:
        self._put(keys.busy, generation, b"1" if busy else b"0", quiet=b"0")

    def waits(self, generation: int, nnodes: int, mine: Mapping[int, tuple[int, int]],
              ask: bool) -> dict[int, tuple[int, int]]:
        """Publish where this node's idle ranks wait (``{global rank: (code, site)}``, waitsample.py;
        one write when it changes) and, when ``ask``, read the other nodes': the same map, merged."""
        self._put(keys.wait, generation, b",".join(b"%d:%d:%d" % (r, c, s) for r, (c, s) in sorted(mine.items())), quiet=b"")
        if not ask or nnodes < 2:
            return {}
        out: dict[int, tuple[int, int]] = {}
        for value in self._others(keys.wait, generation, nnodes):
            for entry in value.split(b","):
                parts = entry.split(b":")
                if len(parts) == 3 and all(p.isdigit() for p in parts):
                    out[int(parts[0])] = (int(parts[1]), int(parts[2]))
        return out

    def others_busy(self, generation: int, nnodes: int) -> bool:
        return b"1" in self._others(keys.busy, generation, nnodes)

    def _put(self, key: Callable[[int, int], str], generation: int, value: bytes, *, quiet: bytes) -> None:
        """This node's ``key``, written when it changes (never while it was only ``quiet``)."""
        last = self._last.get(key)
        if last == (generation, value) or (last is None and value == quiet):
            return
        try:
            self.store.set(key(generation, self.node), value)
            self._last[key] = (generation, value)
        except store_errors():
            pass  # the store's host is gone: the liveness check reports it

    def _others(self, key: Callable[[int, int], str], generation: int, nnodes: int) -> list[bytes]:
        """The other nodes' ``key`` where it exists (none on a store error)."""
        theirs = [key(generation, n) for n in range(nnodes) if n != self.node]
        try:
            return [bytes(self.store.get(k)) for k in theirs if self.store.check([k])]
        except store_errors():
            return []
