"""``--rdzv-backend tierckpt``: torch elastic's rendezvous handler interface, one round on the job
store with O(1) store operations per node (torch's c10d handler re-reads and rewrites the whole
round state, O(N) per node and per keep-alive).

Registered as ``tierckpt`` in torch elastic's handler registry (``register()``; ``tierckpt run``
calls it, and the ``torchrun.handlers`` entry point makes it available to plain ``torchrun``), so
``--rdzv-endpoint``, ``--rdzv-id``, ``--rdzv-conf`` and ``--nnodes MIN:MAX`` keep their meaning.
The store is the one torch's c10d backend would create from the same parameters (the endpoint's
host serves it; ``is_host`` and ``read_timeout`` in ``--rdzv-conf`` as for c10d).

A round ``k`` (keys under ``tierckpt/rdzv/<run id>/``; every value a small integer):

    round                 the open round k (absent: 0); raised to k+1 by the round's close
    r<k>/n                arrivals in round k (``add``: the arrival index, 0 first)
    r<k>/lead             the arrival index that leads round k (absent: 0, the first arrival)
    r<k>/beat             the leader's counter while it decides (a waiting node takes over a stale one)
    r<k>/who/<i>          arrival i's host name and pid, and its rank claim when the launcher gave
                          the handler one (``claim``: the rank it held, whether it held it in this
                          process, its identity, the digest of the membership it knew)
    r<k>/rejoined         arrivals that were members of an earlier round (``add``): round k ≥ 1 closes
                          only once one of them came (the running job re-forms), as c10d keeps a
                          late node in its wait list until a participant re-joins
    r<k>/running          the running job's beat: each member adds 1 at most once a second from
                          ``num_nodes_waiting`` (its monitor polls it); a round k ≥ 1 whose beat
                          stood still for ``orphan_s`` closes without a re-join (every member of the
                          last round gone, the store served from elsewhere)
    r<k>/rank/<i>         arrival i's rank in the round, set by the leader (one multi_set) before ...
    r<k>/world            the round's size N, set once by its leader: arrivals 0..N-1 are its members.
                          "N claims" when the leader decided the ranks from every member's claim
                          (ranks.assign over the claims in (host name, pid) order: a node keeps the
                          rank it held, a spare takes a lost one's); "N" when some member brought no
                          claim (plain torchrun, an older agent): ranked by (host name, pid), as
                          torch's c10d handler ranks its participants, and the launcher exchanges
                          the claims after the round (ranks.exchange_round)
    r<k>/...              the round's own store (``RendezvousInfo.store``: a PrefixStore): the
                          decision (``RANK_DECIDED``, ``RANK_MEMBERS``, keys.py) and the survivors'
                          map (``rank_known``), and where the agents meet at the join barrier
    closed                the rendezvous is closed (the job ended): no node joins again

Call order (each agent; torch's ``_rendezvous`` calls ``next_rendezvous``):

    next_rendezvous():  k = get(round); i = add(r<k>/n, 1) - 1; a survivor's map once per digest
                        (ranks.offer_known: one add); set(r<k>/who/<i>) with the claim
        a member of an earlier round: add(r<k>/rejoined, 1)
        i == leader:    poll r<k>/n until max_nodes arrived, or min_nodes and ``last_call_timeout``
                        passed (k ≥ 1: and a member of an earlier round rejoined); N = the most
                        nodes the job may run on (``allowed``: replicaDiscreteValues); wait for the
                        N members' who keys (beating; ``claims_s`` at most, then a member that
                        never registered breaks a round with claims: ranks.broken), read them
                        (multi_get), decide (ranks.decide: the survivors' map read once), publish
                        the decision in the round store and the ranks (multi_set), set
                        r<k>/world = "N claims" (compare_set, then set: the wake-up), then
                        round = k+1                                              (the leader only)
        everyone:       wait(r<k>/world) -> N; i < N: a member, with its rank and the decision
                        (one multi_get: ``decided``, the stable rank Rounds.assign takes; without
                        claims get(r<k>/rank/<i>), and Rounds exchanges the claims);
                        i >= N: arrived after the close: join round k+1 (a node waiting there is
                        what ``num_nodes_waiting`` counts while the running round is below max)
    num_nodes_waiting(): one ``add(r<k+1>/n, 0)``: nodes waiting for the next round (0 at max_nodes),
                        and at most once a second ``add(r<k+1>/running, 1)``
    leave():            this node left the running job (a surplus or repeat offender standing by): its
                        next arrival is a newcomer's
    set_closed() / shutdown(): set ``closed``, and the open round's world to 0 unless its leader
                        set it (a wake-up); a node in next_rendezvous then raises RendezvousClosedError

Cost: a node's join is seven store operations (two peeks: closed, round; add, set, wait, get the
world, one multi_get of its rank and the decision; a survivor one add more for its map), and no
exchange follows the round (it was four operations more per node and a second wake-up of every
node: 4096 nodes, lost node → every rank 14 s on threads, bench rdzv); the leader polls one counter
while the round fills (every ``poll_s``) and beats every ``lead_stale_s / 4`` (at most 0.5 s); a
waiting member wakes from its ``wait`` now and then to look at the leader's beat (~5 operations):
the first ``DEPUTIES`` arrivals after the leader every second, the others about every
``max_nodes / WAKES_PER_S`` seconds, so the round's wake-ups stay near ``WAKES_PER_S`` a second at
any size. A running job costs one ``add`` per node per poll of ``num_nodes_waiting`` below
max_nodes, and one ``add`` a second for its beat (the liveness of nodes is the launcher's own,
liveness.py).
A leader that dies before it closes the round stops beating; a node that sees its beat stand still
for ``lead_stale_s`` (a deputy, within a second; any member at its next wake-up) takes the lead
(``compare_set`` on r<k>/lead) and closes the round itself.
"""

from __future__ import annotations

import datetime
import os
import random
import socket
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from tierckpt.launcher.control import keys
from tierckpt.launcher.control.store import multi_get_parts, peek, store_errors, timeout_error, wait_parts
from tierckpt.launcher.membership import ranks

__all__ = ["BACKEND", "TierckptRendezvousHandler", "create_handler", "handler_creator", "register"]

BACKEND = "tierckpt"

#: members right after the leader in arrival order that watch its beat every second (``_watch_s``)
DEPUTIES = 4
#: what all the other members of a round wake up at, together, per second (``_watch_s``)
WAKES_PER_S = 64.0


#: the world key's mark of a round whose leader decided the ranks from the members' claims ("<N> claims")
_CLAIMS = "claims"


def _int(raw: bytes | None, default: int = 0) -> int:
    return default if raw is None else int(raw)


class TierckptRendezvousHandler(RendezvousHandler):
    """One round on the job store per call of ``next_rendezvous``; see the module doc."""

    def __init__(self, store: Any, run_id: str, *, min_nodes: int, max_nodes: int,
                 join_timeout_s: float = 600.0, last_call_s: float = 30.0, poll_s: float = 0.01,
                 lead_stale_s: float = 3.0, orphan_s: float = 10.0,
                 claims_s: float = ranks.CLAIMS_TIMEOUT_S) -> None:
        if min_nodes < 1 or max_nodes < min_nodes:
            raise ValueError(f"min_nodes {min_nodes} and max_nodes {max_nodes}: need 1 <= min <= max")
        self.store = store  # the job store (a TCPStore): JobControl, liveness and the rounds share it
        self.run_id = run_id
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.join_timeout_s = join_timeout_s
        self.last_call_s = last_call_s
        self.poll_s = poll_s
        self.lead_stale_s = lead_stale_s
        self.orphan_s = orphan_s
        self.claims_s = claims_s  # how long the leader waits for a member's descriptor (with claims: then breaks)
        #: this node's rank claim, built at each arrival (the launcher's, membership/rounds.py, via
        #: torch_rdzv.claim_with): with every member's, the round's leader decides the stable ranks
        #: itself (``ranks.decide``) and no exchange follows the round; None: ranks in host order
        self.claim: Callable[[], ranks.Claim] | None = None
        #: the last round's decision as this node read it (with claims; None: the round ranked by host)
        self.decided: ranks.Decided | None = None
        #: the node counts the job may run on (``Elastic.allowed``; empty: every count MIN..MAX); the
        #: supervisor narrows it from the job file (torch_rdzv.narrow)
        self.allowed: tuple[int, ...] = ()
        self._prefix = f"tierckpt/rdzv/{run_id}/"
        self._host = socket.getfqdn()
        self.round: int | None = None  # the round this node last joined as a member
        self.world: int | None = None
        self.arrived: tuple[int, int] | None = None  # (round, arrival index) while it waits in one
        self._beat_at = 0.0  # the last beat of the running job (num_nodes_waiting)

    # ---- keys ----
    def _key(self, name: str) -> str:
        return self._prefix + name

    def _r(self, k: int, name: str) -> str:
        return self._prefix + f"r{k}/{name}"

    # ---- torch's interface ----
    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return False  # the workers meet on a store of their own per generation (the supervisor's master)

    def get_run_id(self) -> str:
        return self.run_id

    def is_closed(self) -> bool:
        return peek(self.store, self._key("closed")) is not None

    def set_closed(self) -> None:
        """Close the rendezvous, and wake the nodes waiting in the open round at once (they block
        on its world key for long: ``_watch_s``): its world is set to 0 unless its leader set
        it, so each of them finds no seat and reads ``closed``."""
        self.store.set(self._key("closed"), b"1")
        key = self._r(_int(peek(self.store, self._key("round"))), "world")
        self.store.set(key, bytes(self.store.compare_set(key, b"", b"0")))  # set: the legacy server's wake-up

    def shutdown(self) -> bool:
        try:
            self.set_closed()
        except store_errors():
            return False
        return True

    def num_nodes_waiting(self) -> int:
        """Nodes that arrived for the next round while this one runs below ``max_nodes``; the
        running job's beat, at most once a second (a late node's round waits while it moves)."""
        if self.round is None:
            return 0
        now = time.monotonic()
        if now - self._beat_at >= 1.0:
            self._beat_at = now
            self.store.add(self._r(self.round + 1, "running"), 1)
        if self.world is not None and self.world >= self.max_nodes:
            return 0
        return int(self.store.add(self._r(self.round + 1, "n"), 0))

    def leave(self) -> None:
        """This node left the running job: it beats no more, and its next arrival is a newcomer's."""
        self.round, self.world = None, None

    def next_rendezvous(self) -> RendezvousInfo:
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            if self.is_closed():
                raise RendezvousClosedError(f"the rendezvous of run {self.run_id!r} is closed")
            claim = self.claim() if self.claim is not None else None
            k = _int(peek(self.store, self._key("round")))
            i = int(self.store.add(self._r(k, "n"), 1)) - 1
            who = f"{self._host}\n{os.getpid()}"
            if claim is not None:  # before the descriptor: the leader reads the map once it has them all
                ranks.offer_known(self._round_store(k), claim)
                who += "\n" + claim.to_json().decode()
            self.store.set(self._r(k, f"who/{i}"), who.encode())
            if self.round is not None:  # a member of an earlier round: the running job re-forms
                self.store.add(self._r(k, "rejoined"), 1)
            self.arrived = (k, i)
            world, claimed = self._await_world(k, i, deadline, claim)
            if i < world:
                self.round, self.world, self.arrived, self.decided = k, world, None, None
                round_store = self._round_store(k)
                if claimed and claim is not None:  # the leader decided the stable ranks: one read, no exchange
                    rank_raw, raw = self.store.multi_get([self._r(k, f"rank/{i}"), self._round_key(k, keys.RANK_DECIDED)])
                    self.decided = ranks.decided_from(bytes(raw), int(bytes(rank_raw)), round_store, claim)
                    rank = self.decided.rank
                else:
                    rank = int(self.store.get(self._r(k, f"rank/{i}")))
                info = RendezvousStoreInfo(master_addr=str(getattr(self.store, "host", "127.0.0.1")),
                                           master_port=int(getattr(self.store, "port", 0)))
                return RendezvousInfo(round_store, rank, world, info)
            # arrived after the close: the next round (the close raised ``round`` already)

    def _round_store(self, k: int) -> Any:
        import torch.distributed as dist

        return dist.PrefixStore(self._r(k, ""), self.store)  # type: ignore[attr-defined]

    def _round_key(self, k: int, name: str) -> str:
        """The job store's name of the round store's key ``name`` (torch's PrefixStore joins with '/')."""
        return self._r(k, "") + "/" + name

    def _await_world(self, k: int, i: int, deadline: float, claim: ranks.Claim | None) -> tuple[int, bool]:
        """Round k's size, and whether its leader decided the ranks from the members' claims:
        decided here if this node leads it (``claim``: its own), else waited for. A ``wait`` that
        returns means the key is set (nothing here ``compare_set``s it without setting it, and a
        ``peek`` would: torch's libuv server wakes every waiter on a key at any compare_set, so
        each member's peek woke all the others), so the member reads it at once."""
        if i == 0:
            self._lead(k, deadline, claim)
        key = self._r(k, "world")
        beat_seen, beat_at = -1, time.monotonic()
        lead_seen = b""  # the lead key as this member last saw it (absent: arrival 0 leads)
        while True:
            now = time.monotonic()
            if now > deadline:
                raise RendezvousTimeoutError(f"round {k} of run {self.run_id!r} did not form within "
                                             f"{self.join_timeout_s:g}s ({self._arrivals(k)} of {self.min_nodes} "
                                             "nodes needed arrived)")
            try:  # block on the key, waking now and then to see whether the leader still beats
                self.store.wait([key], datetime.timedelta(seconds=min(self._watch_s(i), max(0.01, deadline - now))))
                size, _, how = bytes(self.store.get(key)).decode().partition(" ")
                return int(size), how == _CLAIMS
            except timeout_error():
                pass
            if self.is_closed():
                raise RendezvousClosedError(f"the rendezvous of run {self.run_id!r} is closed")
            beat = _int(peek(self.store, self._r(k, "beat")), -1)
            if beat != beat_seen:
                beat_seen, beat_at = beat, time.monotonic()
            elif time.monotonic() - beat_at >= self.lead_stale_s:
                # from the leader it judged stale only: two members that judged the same leader stale took
                # the lead one after the other when the second read the key after the first took it (two
                # leaders: one's peeks of the members' keys woke the other's wait on them, on torch's libuv
                # server, and its multi_get then blocked for the store's timeout; test_rdzv)
                took = bytes(self.store.compare_set(self._r(k, "lead"), lead_seen, str(i).encode()))
                if took == str(i).encode():
                    self._lead(k, deadline, claim)
                lead_seen, beat_at = took, time.monotonic()  # another took it: it gets lead_stale_s

    def _watch_s(self, i: int) -> float:
        """How long arrival ``i`` blocks on the world key between looks at its leader's beat.

        The first ``DEPUTIES`` arrivals after the leader look every second (a leader that died
        is replaced within ``lead_stale_s`` + 1 s, as before); every other member only as a
        backstop, every ``max_nodes / WAKES_PER_S`` seconds (at least 1 s), jittered, so a round
        costs the store about ``WAKES_PER_S`` wake-ups a second (each ~5 operations) whatever its
        size. A round of 4096 members that each woke every second made ~20k operations a second,
        more than torch's legacy store server serves to 4096 clients (~5.5k), and starved the
        leader's own polls (bench rdzv: the round did not form in 360 s). The round's close, the
        rendezvous' close (``set_closed``) and the join deadline wake them in time regardless."""
        if i <= DEPUTIES:
            return 1.0
        return max(1.0, self.max_nodes / WAKES_PER_S) * random.uniform(0.5, 1.5)

    def _arrivals(self, k: int) -> int:
        return int(self.store.add(self._r(k, "n"), 0))

    def _lead(self, k: int, deadline: float, claim: ranks.Claim | None) -> None:
        """Decide round k: wait for max_nodes, or for min_nodes and the last call; close it (``claim``:
        the leader's own rank claim, ``_rank``)."""
        min_since: float | None = None
        beat = self._r(k, "beat")
        rejoined = k == 0 or self.round is not None  # round 0 follows no round
        running, running_at = -1, time.monotonic()
        beat_every = min(0.5, self.lead_stale_s / 4)  # the members judge the beat over lead_stale_s
        beat_at = -beat_every
        while True:
            n = self._arrivals(k)
            now = time.monotonic()
            if not rejoined and n >= self.min_nodes:  # k ≥ 1: the running job re-forms, or is gone
                rejoined = int(self.store.add(self._r(k, "rejoined"), 0)) > 0
                beats = int(self.store.add(self._r(k, "running"), 0))
                if beats != running:
                    running, running_at = beats, now
                elif now - running_at >= self.orphan_s:
                    rejoined = True  # nothing of the running job beat for orphan_s: it is gone
            if rejoined and n >= self.max_nodes:
                break
            if rejoined and n >= self.min_nodes and self._floor(n) is not None:
                min_since = now if min_since is None else min_since
                if now - min_since >= self.last_call_s:
                    break
            if now > deadline:
                raise RendezvousTimeoutError(f"round {k} of run {self.run_id!r}: {n} of {self.min_nodes} nodes "
                                             f"needed arrived within {self.join_timeout_s:g}s")
            if now - beat_at >= beat_every:  # not every poll: one operation a poll while the round fills
                beat_at = now
                if self.is_closed():
                    raise RendezvousClosedError(f"the rendezvous of run {self.run_id!r} is closed")
                self.store.add(beat, 1)
            time.sleep(self.poll_s)
        world = self._floor(n) or min(n, self.max_nodes)
        value = str(world).encode()
        if self._rank(k, world, deadline, beat_every, claim):
            value += b" " + _CLAIMS.encode()
        # compare_set: a leader that took over from a stale one and the stale one decide once between them;
        # then set the decided value again (the same bytes), since torch's legacy TCPStore server
        # (use_libuv=False) wakes no waiter on a compare_set: the members would see the close only at the
        # end of their 1 s wait (and, at 64 nodes, some of them 6 s late; bench rdzv)
        key = self._r(k, "world")
        self.store.set(key, bytes(self.store.compare_set(key, b"", value)))
        self.store.compare_set(self._key("round"), str(k).encode() if k else b"", str(k + 1).encode())

    def _floor(self, n: int) -> int | None:
        """The most nodes the round may close with when ``n`` arrived (None: fewer than MIN); the
        arrivals past it wait for the next round."""
        n = min(n, self.max_nodes)
        ok = [a for a in (self.allowed or range(self.min_nodes, self.max_nodes + 1)) if self.min_nodes <= a <= n]
        return max(ok) if ok else None

    def _rank(self, k: int, world: int, deadline: float, beat_every: float, mine: ranks.Claim | None) -> bool:
        """The members' ranks, set under ``r<k>/rank/<i>``; True when decided from their claims.

        The torch rank order is (host name, pid), as torch's c10d handler orders its participants
        (a job started host by host gets its ranks in host order). When this node (``mine``) and
        every member registered a rank claim, the ranks are ``ranks.assign``'s over the claims in that order
        (the survivors keep theirs, the spare takes the lost one's) and the decision goes to the
        round's store (``RANK_MEMBERS``, ``RANK_DECIDED``): a member that never registered breaks
        the round (``ranks.broken``). Without claims, the torch rank order is the rank, and a member
        that never registered ranks last."""
        who = [self._r(k, f"who/{i}") for i in range(world)]
        descs = []
        for i, raw in enumerate(self._descriptors(k, who, deadline, beat_every)):
            host, _, rest = (raw or "\uffff\n0".encode()).decode().partition("\n")
            pid, _, claim = rest.partition("\n")
            descs.append((host, int(pid or 0), i, ranks.Claim.from_json(claim.encode()) if claim else None, raw is None))
        order = sorted(descs)
        rank_keys = [self._r(k, f"rank/{i}") for _, _, i, _, _ in order]
        if mine is None or any(c is None and not missing for _, _, _, c, missing in order):
            self.store.multi_set(rank_keys, [str(rank).encode() for rank in range(world)])
            return False
        round_store = self._round_store(k)
        gone = [i for _, _, i, _, missing in order if missing]
        if gone:
            why = (f"arrival(s) {gone} of round {k} registered no rank claim within {self.claims_s:g}s (gone since "
                   "their arrival)")
            round_store.set(keys.RANK_DECIDED, ranks.broken(why))
            self.store.multi_set(rank_keys, [b"-1"] * world)
            return True
        claims = [c for _, _, _, c, _ in order if c is not None]
        d = ranks.decide(round_store, claims, self.claims_s, mine)
        round_store.set(keys.RANK_MEMBERS, d.members)
        round_store.set(keys.RANK_DECIDED, d.decided)
        self.store.multi_set(rank_keys, [str(rank).encode() for rank in d.order])
        return True

    def _descriptors(self, k: int, who: list[str], deadline: float, beat_every: float) -> list[bytes | None]:
        """Every member's descriptor (None: not set within ``claims_s``, or ``lead_stale_s`` without
        claims), beating while it waits
        (the deputies would take over a silent leader)."""
        until = min(deadline, time.monotonic() + (self.claims_s if self.claim is not None else self.lead_stale_s))
        while True:
            try:  # every member sets its key right after its arrival
                wait_parts(self.store, who, max(0.01, min(beat_every, until - time.monotonic())))
                if self.store.check(who):  # a wait returns without its keys on torch's libuv server when
                    return list(multi_get_parts(self.store, who))  # another client peeks one (a second leader's)
            except timeout_error():
                pass
            if time.monotonic() >= until:  # one died between its arrival and its key
                return [peek(self.store, key) for key in who]
            self.store.add(self._r(k, "beat"), 1)

    # ---- what the launcher reads (membership/torch_rdzv.py) ----
    def joined(self) -> int | None:
        """Arrivals so far in the round this node waits in (None when it waits in none)."""
        arrived = self.arrived
        return None if arrived is None else self._arrivals(arrived[0])


def create_handler(params: RendezvousParameters) -> TierckptRendezvousHandler:
    """torch's registry calls this with the launcher's parameters (``--rdzv-*``, ``--nnodes``)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    _, store = create_backend(params)  # the same store, hosted by the same node, as c10d's
    return TierckptRendezvousHandler(
        store, params.run_id, min_nodes=params.min_nodes, max_nodes=params.max_nodes,
        join_timeout_s=float(params.get_as_int("join_timeout", 600) or 600),
        last_call_s=float(params.get("last_call_timeout", 30.0)),
        lead_stale_s=float(params.get("lead_stale_timeout", 3.0)),
        orphan_s=float(params.get("orphan_timeout", 10.0)))


def handler_creator() -> Any:
    """The ``torchrun.handlers`` entry point: torch calls it for the creator to register."""
    return create_handler


def register() -> None:
    """Register ``tierckpt`` in torch elastic's handler registry (again: a no-op)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, create_handler)
