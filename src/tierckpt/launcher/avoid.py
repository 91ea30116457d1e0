"""Enforcing ``maxNumRepeatOffendersToAvoid``: the job-store shell around ``offenders.OffenderPolicy``.

At each restart decision that stops every node's workers (all of them acked the stop barrier,
so the offender is alive and present), every agent calls ``RepeatOffenders.keep_out``:

1. the fault of generation ``g`` is **attributed** to the identity its claim's node had in the
   membership of ``g`` (``offenders.attribute``) and merged into one job-store key,
   ``tierckpt/run/offenses`` (a JSON object ``{generation: {"identity", "time", "reason"}}``,
   updated by compare-and-set; the same entry from every agent, so the merge is idempotent);
2. the first agent to get there computes ``OffenderPolicy.exclude(faults, spares=<spares at
   the gate>)`` and publishes it under ``tierckpt/run/keep-out/<g>`` (compare-and-set: the first
   answer is everyone's, though agents read the gate's count at different moments);
3. every agent gets the group ranks whose identity is kept out. The agents of those ranks stand
   aside (``leave_round``, then the spare gate), the others open one seat per such rank and go
   through torch's rendezvous round, where the waiting spares take the free ranks (``ranks.py``).

The offenses are also kept in the restart-state file (``remembered`` / ``remember``), so that a
full job restart (a new store) still knows them: every agent merges its own into the new store
after the first rendezvous round.

Call order (``TierckptAgent``):

    avoid = RepeatOffenders(OffenderPolicy.from_restart_policy(run_policy.restart_policy))
    avoid.remember(job_store, state.get("offenses"))               # after each rendezvous round
    avoid.record(job_store, g, fault, members)                     # at every fault claim
    out = avoid.keep_out(job_store, g, fault, members, spares=spares_waiting(job_store))  # a restart, all stopped
    ...an agent whose rank is in ``out``: events "offender"; leave_round(handler); the spare gate
    state["offenses"] = avoid.remembered                           # with every restart-state save
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tierckpt.launcher.offenders import NodeFault, OffenderPolicy, attribute

__all__ = ["KeepOut", "RepeatOffenders", "leave_round"]

_OFFENSES = "tierckpt/run/offenses"
_KEEP_OUT = "tierckpt/run/keep-out/"
_ABSENT = b"\x00absent"  # compare_set(key, _ABSENT, _ABSENT) reads a key without blocking or writing


@dataclass(frozen=True)
class KeepOut:
    """The agreed answer for one generation: the group ranks to do without, their identities, and
    the spares waiting at the gate when the first agent decided."""

    ranks: tuple[int, ...] = ()
    identities: tuple[str, ...] = ()
    spares: int = 0

    def __bool__(self) -> bool:
        return bool(self.ranks)


class RepeatOffenders:
    """Attributed faults in the job store and the agreed keep-out list per generation; see the module doc."""

    def __init__(self, policy: OffenderPolicy) -> None:
        self.policy = policy
        self.remembered: dict[str, dict[str, Any]] = {}  # the offenses as last read (for the state file)

    @property
    def enabled(self) -> bool:
        return self.policy.max_avoid > 0

    def remember(self, store: Any, offenses: Any) -> None:
        """Merge offenses kept in this node's restart-state file into the job store (after a round)."""
        if not self.enabled or not isinstance(offenses, dict) or not offenses:
            return
        clean = {str(g): dict(v) for g, v in offenses.items()
                 if isinstance(v, dict) and isinstance(v.get("identity"), str) and isinstance(v.get("time"), (int, float))}
        self.remembered = _merge(store, _OFFENSES, lambda cur: {**clean, **cur})

    def record(self, store: Any, generation: int, fault: dict[str, Any], members: dict[int, str]) -> None:
        """Attribute ``fault`` (the claim of ``generation``) to its node's identity in ``members``
        (this round's rank -> identity) and merge it into the store; at every fault, whatever the
        decision, so that a full job restart keeps it (the state file saves ``remembered``)."""
        if not self.enabled:
            return
        entry = {str(generation): {"identity": f.identity, "time": f.time, "reason": str(fault.get("reason"))}
                 for f in attribute([fault], [members])}
        self.remembered = _merge(store, _OFFENSES, lambda cur: {**cur, **entry}) if entry else _read(store, _OFFENSES)

    def keep_out(self, store: Any, generation: int, fault: dict[str, Any], members: dict[int, str], *,
                 spares: int) -> KeepOut:
        """The group ranks (of ``members``) that the next round must do without; the same answer on
        every agent. Records ``fault`` first (``record``; the same entry twice writes nothing)."""
        if not self.enabled:
            return KeepOut()
        self.record(store, generation, fault, members)
        mine = json.dumps({"out": self.policy.exclude(self.faults(), spares=spares), "spares": spares}).encode()
        agreed = json.loads(bytes(store.compare_set(f"{_KEEP_OUT}{generation}", b"", mine)))
        ranks = tuple(sorted(rank for rank, ident in members.items() if ident in agreed["out"]))
        return KeepOut(ranks, tuple(members[r] for r in ranks), int(agreed["spares"]))

    def faults(self) -> list[NodeFault]:
        """The attributed faults as last read, oldest first."""
        return sorted((NodeFault(str(v["identity"]), float(v["time"])) for v in self.remembered.values()),
                      key=lambda f: (f.time, f.identity))

    def count(self, identity: str) -> int:
        """Faults attributed to ``identity`` within the policy's window (for the ``offender`` event)."""
        faults = self.faults()
        if not faults:
            return 0
        newest = max(f.time for f in faults)
        window = self.policy.window_s
        return sum(1 for f in faults if f.identity == identity and (window is None or f.time >= newest - window))


def _read(store: Any, key: str) -> dict[str, dict[str, Any]]:
    raw = bytes(store.compare_set(key, _ABSENT, _ABSENT))
    return {} if raw == _ABSENT else dict(json.loads(raw))


def _merge(store: Any, key: str, update: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """Compare-and-set ``key`` (a JSON object) to ``update(current)`` until no other agent raced it."""
    while True:
        raw = bytes(store.compare_set(key, _ABSENT, _ABSENT))
        cur = {} if raw == _ABSENT else dict(json.loads(raw))
        new = update(cur)
        if new == cur:
            return cur
        body = json.dumps(new, sort_keys=True).encode()
        if bytes(store.compare_set(key, b"" if raw == _ABSENT else raw, body)) == body:
            return new


def leave_round(handler: Any) -> bool:
    """Take this agent out of torch's completed rendezvous round, so that the others' next round
    does not wait for its keep-alive to expire: stop the keep-alive beat and run the handler's own
    exit operation (what ``next_rendezvous`` runs first). Private parts of torch's c10d
    ``DynamicRendezvousHandler`` (read in torch 2.13), each looked up with ``getattr``; False when
    one is missing (then only the keep-alive stops, if it can, and the others wait for its
    expiry, ``keep_alive_interval x keep_alive_max_attempt``)."""
    stop = getattr(handler, "_stop_heartbeats", None)
    if not callable(stop):
        return False
    stop()
    executor = getattr(handler, "_op_executor", None)
    deadline = getattr(handler, "_get_deadline", None)
    timeout = getattr(getattr(getattr(handler, "_settings", None), "timeout", None), "close", None)
    try:
        from torch.distributed.elastic.rendezvous.api import RendezvousError
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp
    except ImportError:
        return False
    if executor is None or not callable(deadline) or timeout is None:
        return False
    try:
        executor.run(_RendezvousExitOp(), deadline(timeout))
    except RendezvousError:  # the store is busy or gone: the stopped keep-alive expires all the same
        return False
    return True
