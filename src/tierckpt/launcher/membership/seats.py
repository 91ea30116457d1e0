"""The first round's seats: which of the agents that start together are the job's first MAX nodes.

The spare gate (spares.py) knows the job is full from ``tierckpt/run/nodes``, which group rank 0
publishes only after the first round formed; an agent that arrived while that round formed went
straight into torch's rendezvous, and the one beyond ``max_nodes`` ended in torch's redundancy
list, whose keep-alive hazard the gate exists to avoid. Spare pods start with the worker pods
(``tierckpt k8s render``) and a Slurm allocation starts every node at once, so an agent that
finds no published node count takes a **seat** in the job store before torch's rendezvous:

- ``take``: the seat this node's identity (``ranks.identity``, host:memory root) already holds
  is given back (a launcher restarted on the same host before the round formed); otherwise one
  ``add`` on a ticket counter, and tickets ``0 .. max_nodes-1`` are seats (``compare_set`` binds
  seat k to its identity, and the identity to k). A ticket beyond them is a spare's: the agent
  waits at the gate (``SeatWatch``) and never enters torch's first round. For ``MIN:MAX`` every
  one of the first MAX nodes enters the round (torch's last call admits those beyond MIN).
- ``SeatBeat``: a seat holder moves a counter of its seat about once a second, from its own
  store client, until the node count is published (the round formed).
- ``SeatWatch``: a spare waiting while the round forms watches every seat's (holder, beat);
  a seat whose pair has not moved for ``stale_s`` (``--node-timeout``, by the spare's own clock)
  belongs to a node that died before the round formed: the spare takes it with one
  ``compare_set(seat, dead holder, itself)`` (one seat, one spare; a holder that comes back finds
  it lost the seat and becomes a spare) and enters the round in its place, where torch's own
  keep-alive expiry (3 s) has dropped the dead node if it had joined. Once the count is
  published, the spare goes on at the ordinary gate (``SpareGate``: a ticket for the seats that
  survivors open, or an arrival if the job formed below MAX).

Call order (``SpareGate.wait`` with ``seats=FirstSeats(...)``, only while no node count is published):

    seat = take(store, identity, max_nodes)            # None: a spare
    beat = SeatBeat(connect, seat); beat.start()        # a seat holder, into torch's round
    ...a spare: watch = SeatWatch(store, max_nodes, stale_s); watch.poll() -> seat it took, or None
    beat.stop()                                         # at exit; it stops by itself once the round formed
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tierckpt.launcher.control import keys
from tierckpt.launcher.control.store import peek

__all__ = ["FirstSeats", "SeatBeat", "SeatWatch", "beat", "holder", "take"]

def holder(store: Any, seat: int) -> str | None:
    """The identity holding ``seat`` (None: its ticket was drawn but not bound yet, or not drawn)."""
    raw = peek(store, keys.first_seat(seat))
    return None if raw is None else raw.decode()


def _bind(store: Any, seat: int, identity: str, expected: bytes) -> bool:
    me = identity.encode()
    if bytes(store.compare_set(keys.first_seat(seat), expected, me)) != me:
        return False
    store.set(keys.first_seat_of(identity), str(seat).encode())
    store.add(keys.first_seat_beat(seat), 1)
    return True


def take(store: Any, identity: str, max_nodes: int) -> int | None:
    """This node's seat in the first round (0 .. max_nodes-1), or None: the seats are taken, it is
    a spare. A few store operations; never blocks."""
    had = peek(store, keys.first_seat_of(identity))
    if had is not None and holder(store, int(had)) == identity:
        store.add(keys.first_seat_beat(int(had)), 1)
        return int(had)  # a restarted launcher of this node: its own seat back, no new ticket
    ticket = int(store.add(keys.FIRST_SEAT_TICKETS, 1)) - 1
    if ticket < max_nodes and _bind(store, ticket, identity, b""):
        return ticket
    return None  # beyond the seats (or a spare took this ticket's seat meanwhile: this node was stale)


def beat(store: Any, seat: int) -> None:
    store.add(keys.first_seat_beat(seat), 1)


class SeatBeat:
    """A seat holder's beat: ``beat`` every ``every_s`` from its own store client until ``stop``
    or until the first round's node count is published."""

    def __init__(self, connect: Callable[[], Any], seat: int, *, every_s: float = 1.0) -> None:
        self.connect = connect
        self.seat = seat
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierckpt-seat-beat", daemon=True)

    def start(self) -> SeatBeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            store = self.connect()
            while not self._stop.wait(self.every_s):
                if store.check([keys.NODES]):
                    return
                beat(store, self.seat)
        except Exception:  # noqa: BLE001 - the store went away: the job's agents see it themselves
            return


class SeatWatch:
    """A spare's view of the seats while the first round forms; ``poll`` takes a seat whose holder
    went silent. The clock is the spare's own (``now``, monotonic seconds), so hosts' clocks never
    need to agree."""

    def __init__(self, store: Any, identity: str, max_nodes: int, stale_s: float) -> None:
        self.store = store
        self.identity = identity
        self.max_nodes = max_nodes
        self.stale_s = stale_s
        self._seen: dict[int, tuple[bytes | None, bytes | None, float]] = {}

    def poll(self, now: float | None = None) -> int | None:
        """Read every seat once (2 operations a seat); the seat this spare took, or None."""
        now = time.monotonic() if now is None else now
        st = self.store
        for k in range(self.max_nodes):
            who, count = peek(st, keys.first_seat(k)), peek(st, keys.first_seat_beat(k))
            seen = self._seen.get(k)
            if seen is None or seen[:2] != (who, count):
                self._seen[k] = (who, count, now)
                continue
            if now - seen[2] > self.stale_s and _bind(st, k, self.identity, b"" if who is None else who):
                return k
        return None


@dataclass(frozen=True)
class FirstSeats:
    """What ``SpareGate`` needs to seat agents before the first round: this node's identity, how
    long a silent seat holder is given (``--node-timeout``), and how to open a store client for
    the seat's beat."""

    identity: str
    stale_s: float
    connect: Callable[[], Any]
