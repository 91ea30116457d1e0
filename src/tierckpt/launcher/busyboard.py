"""Which nodes have a rank that is silent but busy, on the rendezvous store: what the other ranks are doing.

    board = BusyBoard(store, node)               # the agent, after each rendezvous round
    board.exchange(generation, nnodes, busy, ask)  # each poll (procwatch.sample_ranks): publish
                                                 # this node's state (one write when it changes);
                                                 # when ``ask`` (a local rank is idle near its
                                                 # limit), whether another node has a busy rank

A rank that waits idle in a collective for a rank of another node which is computing (an
evaluation pass on rank 0 alone, a synchronous save) is not hung; hang.py's idle rule asks this
board before it fires. Keys: ``tierckpt/run/busy/<generation>/<node>`` = ``1`` or ``0``; a new
generation starts with none. An agent that dies while its key says ``1`` is a lost node
(control.Liveness), so a stale ``1`` does not excuse a hang for longer than ``--node-timeout``
before the job restarts anyway.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BusyBoard"]

_P = "tierckpt/run/busy/"


def _store_errors() -> tuple[type[BaseException], ...]:
    import torch.distributed as dist

    return (RuntimeError, dist.DistError) if hasattr(dist, "DistError") else (RuntimeError,)


class BusyBoard:
    """One node's view of the store keys above; a store error reads as "no one busy"."""

    def __init__(self, store: Any, node: int) -> None:
        self.store = store
        self.node = node
        self._published: tuple[int, bool] | None = None

    def exchange(self, generation: int, nnodes: int, busy: bool, ask: bool) -> bool:
        self.publish(generation, busy)
        return ask and nnodes > 1 and self.others_busy(generation, nnodes)

    def publish(self, generation: int, busy: bool) -> None:
        if self._published == (generation, busy) or (self._published is None and not busy):
            return
        try:
            self.store.set(f"{_P}{generation}/{self.node}", b"1" if busy else b"0")
            self._published = (generation, busy)
        except _store_errors():
            pass  # the store's host is gone: the liveness check reports it

    def others_busy(self, generation: int, nnodes: int) -> bool:
        keys = [f"{_P}{generation}/{n}" for n in range(nnodes) if n != self.node]
        try:
            return any(self.store.check([k]) and self.store.get(k) == b"1" for k in keys)
        except _store_errors():
            return False
