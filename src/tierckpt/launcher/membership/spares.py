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

That redundancy list is not safe on a loaded machine: every sync of the waiting spare drops
participants whose keep-alive looks older than ``keep_alive_interval x keep_alive_max_attempt``
(3 s under ``tierckpt run``), so a participant whose beat is late makes the spare join the wait
list, the job restarts for a membership change, and the spare can take a live node's place
(seen at load average 9 here). So an agent that finds the job running on ``max_nodes`` waits at
a **gate** in the job store before torch's rendezvous: it draws a ticket (arrival order) and
enters the rendezvous only when the survivors of a lost node have opened a seat for it
(``open_seats``); one seat, one spare. An agent that arrives while the first round forms (no
node count published yet: spare pods start with the worker pods) takes one of the first round's
``max_nodes`` seats first (seats.py: a restarted launcher gets its own seat back; a spare takes
the seat of a holder that went silent before the round formed); without one it stands by here
until the round formed, then goes on at the gate as above, so no spare ever waits in torch's
redundancy list. ``SpareWatch`` still reports an agent found there. An agent that finds the job
below its maximum goes on into the rendezvous and counts itself in ``arrivals``, which the
running agents read at each poll (a ``MembershipChange``): after a regroup torch's own wait list
did not show the new node to the survivor (seen in ``test_elastic_job_shrinks_...``). A repeat
offender standing aside (``offender=True``, avoid.py) marks its tickets and passes a seat on to
the next ticket while a spare that is no offender waits behind it, drawing a new ticket at the
back. A node avoided after a full job restart (``offender=True, hold_s>0``, avoid.py) arriving
while the first round forms draws no seat ticket for ``hold_s``: the other nodes take the seats;
if the round forms without it, it goes on at the gate as an offender; if the hold ends first, it
draws a ticket like any node (``on_hold_over``), so the job never waits below its size for it.
A spare of a finished job leaves once every node called ``finished`` (it may host the store).

Call order (the agent's ``_join``, around torch's blocking ``next_rendezvous``):

    gate = SpareGate(job_store, max_nodes, on_standby, seats=FirstSeats(identity, stale_s, connect))
    since = gate.wait()                            # returns when admitted (or seated in the first round)
    with SpareWatch(handler, on_standby=lambda job_nodes: ...) as watch:
        handler.next_rendezvous()
    gate.beat                                      # a first-round seat holder's beat: ends once the round formed
    publish_nodes(job_store, nnodes)               # group rank 0, after every round or regroup
    ...survivors, going to a new round after losing k nodes:  open_seats(job_store, g, node, k)
    watch.since        # when this agent began standing by as a spare (None: it never did)
    report_round(events, generation, change, node=..., spare_since=watch.since)   # after the round
    finished(job_store)                            # every node of a finished job, after its exit barrier
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tierckpt.launcher.control import keys
from tierckpt.launcher.membership import torch_rdzv
from tierckpt.launcher.membership.change import Change
from tierckpt.launcher.membership.rdzvwait import WhileBlocked
from tierckpt.launcher.membership.seats import FirstSeats, SeatBeat, SeatWatch, take

__all__ = ["JobEnded", "SpareGate", "SpareWatch", "arrivals", "finished", "open_seats", "publish_nodes", "report_round",
           "spares_waiting"]

_DONE = keys.done(0)  # JobControl.mark_done of group rank 0: the job finished


class JobEnded(Exception):  # noqa: N818 - a way out of the gate, not an error
    """The job finished (or its store went away) while this agent stood by as a spare."""


def publish_nodes(store: Any, nnodes: int) -> None:
    """The running round has ``nnodes`` nodes (group rank 0, after every round or regroup)."""
    store.set(keys.NODES, str(nnodes).encode())


def open_seats(store: Any, generation: int, node: int, count: int) -> bool:
    """Survivors going to a new round after losing ``count`` nodes in ``generation``: admit that
    many spares. Every survivor may call it; the first one's count counts (``compare_set``), so
    the seats of one generation open once. True when this call opened them."""
    if count <= 0:
        return False
    me = str(node).encode()
    if bytes(store.compare_set(keys.seats_opened(generation), b"", me)) != me:
        return False
    store.add(keys.SEATS, count)
    return True


def finished(store: Any) -> None:
    """This node of a finished job passed its exit barrier: a spare at the gate (which may host
    the store) leaves once every node did (``SpareGate``)."""
    store.add(keys.FINISHED, 1)


def arrivals(store: Any) -> int:
    """Agents admitted so far into a running job below its maximum (one store operation)."""
    return int(store.add(keys.ARRIVALS, 0))


def spares_waiting(store: Any) -> int:
    """Spares at the gate not yet admitted (two store operations, never blocks)."""
    return max(0, int(store.add(keys.SPARE_TICKETS, 0)) - int(store.add(keys.SEATS, 0)))


class SpareGate:
    """Holds an agent that arrives while the job runs on ``max_nodes`` until a seat opens; see the
    module doc. ``wait`` returns the time it began standing by (None: it never stood by). With
    ``seats`` (seats.py) an agent that arrives before the first round formed takes a seat of that
    round first, or stands by; ``beat`` is then its seat's beat, for the agent to stop after the round."""

    def __init__(self, store: Any, max_nodes: int, on_standby: Callable[[int], None], *,
                 ready: Callable[[], bool] = lambda: True, ready_timeout_s: float = 60.0,
                 on_warm: Callable[[], None] = lambda: None, poll_s: float = 0.2,
                 seats: FirstSeats | None = None, seat_poll_s: float = 1.0, linger_s: float = 60.0,
                 offender: bool = False, hold_s: float = 0.0, on_hold_over: Callable[[], None] = lambda: None) -> None:
        self.store = store
        self.max_nodes = max_nodes
        self.on_standby = on_standby
        self.ready = ready  # this agent's standbys finished their imports
        self.ready_timeout_s = ready_timeout_s
        self.on_warm = on_warm  # a standing-by spare's standbys finished their imports (once)
        self.poll_s = poll_s
        self.seats = seats
        self.seat_poll_s = seat_poll_s  # how often a spare reads the first round's seats (2 operations a seat)
        self.beat: SeatBeat | None = None  # this agent's first-round seat's beat (seats.py)
        self.linger_s = linger_s  # how long a spare of a finished job waits for its nodes to leave the store
        self.offender = offender  # a repeat offender standing aside: other waiting spares go first
        self.hold_s = hold_s  # an avoided offender leaves the first round's seats to others this long
        self.on_hold_over = on_hold_over  # ...and that hold ended before the round formed
        self._since: float | None = None  # when it began standing by
        self._warm = False

    def wait(self) -> float | None:
        """Block until admitted; raise ``JobEnded`` when the job finished meanwhile."""
        st = self.store
        try:
            if self.seats is not None and not st.check([keys.NODES]) and not st.check([_DONE]) \
                    and not self._hold() and self._first_round(self.seats):
                return self._since  # a seat of the first round: into torch's round
        except JobEnded:
            raise
        except Exception as exc:  # noqa: BLE001 - the store's host left: the job is over
            raise JobEnded(f"the job's store went away while this node stood by as a spare: {exc}") from exc
        nodes = int(st.get(keys.NODES)) if st.check([keys.NODES]) else 0
        if st.check([_DONE]):
            return None
        if nodes < self.max_nodes:
            if nodes > 0:  # a running job with room: join it warm, then tell its agents (torch's
                # wait list is not always seen); the job stops for the new round only then
                deadline = time.monotonic() + self.ready_timeout_s  # (the ones its local workers need)
                while not self.ready() and time.monotonic() < deadline:
                    time.sleep(self.poll_s)
                st.add(keys.ARRIVALS, 1)
            return self._since
        ticket = self._draw()
        self._stand_by(nodes)
        try:
            while True:
                seats = int(st.add(keys.SEATS, 0))
                if seats >= ticket:
                    if not (self.offender and self._others_waiting(seats)):
                        break
                    ticket = self._draw()  # a repeat offender yields: to the back of the line, and
                    st.add(keys.SEATS, 1)  # its seat to the next ticket (waiting spares stay T - S)
                    continue
                self._warm_up()
                if st.check([_DONE]):
                    raise self._finished()
                time.sleep(self.poll_s)
        except JobEnded:
            raise
        except Exception as exc:  # noqa: BLE001 - the store's host left: the job is over
            raise JobEnded(f"the job's store went away while this node stood by as a spare: {exc}") from exc
        return self._since

    def _draw(self) -> int:
        """A ticket at the gate, marked when this agent is a repeat offender."""
        ticket = int(self.store.add(keys.SPARE_TICKETS, 1))
        if self.offender:
            self.store.set(keys.offender_ticket(ticket), b"1")
        return ticket

    def _others_waiting(self, seats: int) -> bool:
        """A spare that is no repeat offender holds a ticket not yet admitted (one read a ticket)."""
        drawn = int(self.store.add(keys.SPARE_TICKETS, 0))
        return any(not self.store.check([keys.offender_ticket(t)]) for t in range(seats + 1, drawn + 1))

    def _hold(self) -> bool:
        """An avoided offender before the first round formed: True when the round formed without
        it within ``hold_s`` (it goes on at the gate); False when the hold ended (or there is none)
        and it may take a seat. Raises ``JobEnded``."""
        if not (self.offender and self.hold_s > 0):
            return False
        st = self.store
        self._stand_by(0)
        deadline = time.monotonic() + self.hold_s
        while time.monotonic() < deadline:
            if st.check([keys.NODES]):
                return True
            if st.check([_DONE]):
                raise self._finished()
            self._warm_up()
            time.sleep(self.poll_s)
        if st.check([keys.NODES]):
            return True
        self.on_hold_over()
        return False

    def _first_round(self, seats: FirstSeats) -> bool:
        """Before the first round formed: True when this agent holds a seat of it (drawn, given back,
        or taken from a holder that went silent); False when the round formed meanwhile (the
        ordinary gate decides then). Raises ``JobEnded``."""
        st = self.store
        seat = take(st, seats.identity, self.max_nodes)
        if seat is None:
            self._stand_by(0)
            watch = SeatWatch(st, seats.identity, self.max_nodes, seats.stale_s)
            next_look = 0.0
            while seat is None:
                if st.check([keys.NODES]):
                    return False
                if st.check([_DONE]):
                    raise self._finished()
                self._warm_up()
                if time.monotonic() >= next_look:
                    next_look = time.monotonic() + self.seat_poll_s
                    seat = watch.poll()
                if seat is None:
                    time.sleep(self.poll_s)
        self.beat = SeatBeat(seats.connect, seat).start()
        return True


    def _finished(self) -> JobEnded:
        """The job finished: linger until every node of it passed its exit barrier (``finished``),
        at most ``linger_s``, since this agent may host the job's store (``is_host``), which the
        nodes use until then; a spare that left at once took the store from under them."""
        st = self.store
        nodes = int(st.get(keys.NODES)) if st.check([keys.NODES]) else 0
        deadline = time.monotonic() + self.linger_s
        while int(st.add(keys.FINISHED, 0)) < nodes and time.monotonic() < deadline:
            time.sleep(self.poll_s)
        return JobEnded("the job finished while this node stood by as a spare")
    def _stand_by(self, nodes: int) -> None:
        if self._since is None:
            self._since = time.time()
            self.on_standby(nodes)

    def _warm_up(self) -> None:
        if not self._warm and self.ready():
            self._warm = True
            self.on_warm()


class SpareWatch(WhileBlocked):
    """Watches torch's rendezvous state while a round blocks; calls ``on_standby(job_nodes)`` once,
    from its own thread, when this agent is first found in the redundancy list."""

    thread_name = "tierckpt-spare-watch"

    def __init__(self, handler: Any, on_standby: Callable[[int], None], *, every_s: float = 0.25) -> None:
        self.handler = handler
        self.on_standby = on_standby
        self.every_s = every_s
        self.since: float | None = None  # time.time() when first seen standing by
        super().__init__()

    def _run(self) -> None:
        while not self._done.wait(self.every_s):
            nodes = torch_rdzv.standing_by(self.handler)
            if nodes is not None:
                self.since = time.time()
                try:
                    self.on_standby(nodes)
                except Exception:  # noqa: BLE001 - a report must not break the rendezvous
                    pass
                return


def report_round(events: Any, generation: int, change: Change, *, node: int, spare_since: float | None,
                 via: str = "rendezvous") -> None:
    """The events of a settled round: ``spare`` with ``state: "joined"`` on a spare that took a
    rank (``node``, ``replaced``: the identity of the node that held it, ``standby_s``), and
    ``membership`` (``Change.to_event`` and ``via``: ``rendezvous`` or ``regroup``) on every agent
    when the membership changed."""
    if spare_since is not None:
        events.emit("spare", generation=generation, state="joined", node=node,
                    replaced=change.before.get(node) if change.before.get(node) in change.left else None,
                    standby_s=round(time.time() - spare_since, 3))
    if change:
        events.emit("membership", generation=generation, via=via, **change.to_event())
