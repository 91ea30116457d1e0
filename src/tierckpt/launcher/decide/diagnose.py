"""One cause per fault, blamed on the right node: ``diagnose(evidence, poll) -> Diagnosis`` (pure).

Every poll of the launcher's loop collects what each detector saw as ``FaultRecord`` values
(faults.py) and hands them here with what the poll knows of the other nodes (``Poll``: the agents
the liveness watcher counts lost, and how long each quiet one has been silent). The diagnosis:

1. **Causes before symptoms.** A record without ``symptom`` is a cause; the most specific one wins
   (``faults.SPECIFICITY``: a deadline, a lost store or node, a worker killed or exited, a stopped
   worker, a non-finite loss, a log rule, an unexplained stall, last a node waiting to join), the
   earliest seen among equals.
2. **A symptom names its cause.** A rank whose collective failed because a peer went away (its
   output says "Connection reset by peer", ``symptom.py``) or a rank idle in a collective
   (waitsample.LIB) waits for a peer that is not in it. When another node's agent is silent for
   ``suspect_s`` (``Poll.quiet``; 1.5 s, three liveness intervals, against ``--node-timeout`` of
   10 s; ``crash_suspect_s``, 2.5 s, when the only symptoms are failed collectives, whose peer's
   agent may only be slow to claim its own crash) or counted lost, that node is the cause: ``LostNode`` naming it, long before the liveness
   verdict alone would say so. A symptom never blames the node that observed it while a peer is silent.
3. **A settle window, bounded.** A failed collective with no cause in sight is held for ``settle_s``
   (3 s, ``SETTLE_S``) from the first time it was seen: the failing node's own claim arrives
   in milliseconds and the agent follows it instead. Past the window the symptom is claimed itself
   (``Diagnosis.settle_s`` says how long it waited). A rank idle in a collective past the idle limit
   (the hang rules already waited) is claimed without a window: every rank waits, a deadlock; one
   that names suspects elsewhere (``evidence["suspects"]``: ranks that wait where the majority does
   not, ``odd_ones``; ``evidence["waits_for"]``: a busy rank the others wait for) is held like a
   failed collective, so the
   suspect's node, which sees its own rank's stall as the cause, claims first.
4. A rank idle in a collective before any limit (``Kind.COLLECTIVE_WAIT``) is evidence only: it
   never becomes a fault of its own.

Call order (the agent's poll): ``d = diagnose(records, Poll(node=..., now=..., quiet=..., lost=...,
held_since=<d.held_since of the previous poll, None at a generation's start>))``; claim
``d.cause`` when it is not None, else keep ``d.held_since`` for the next poll. No clock is read, no
store touched: the same evidence gives the same answer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from tierckpt.launcher.decide.faults import FaultRecord, Kind, Reason

__all__ = ["CRASH_SUSPECT_S", "SETTLE_S", "SUSPECT_S", "Diagnosis", "Poll", "diagnose", "odd_ones"]

#: how long a failed collective waits for the claim of its cause (the window bounds what a symptom
#: without a cause adds to recovery; a peer's crash is claimed in milliseconds)
SETTLE_S = 3.0
#: a peer agent silent this long is the cause of a local symptom (3 liveness intervals of 0.5 s)
SUSPECT_S = 1.5
#: ... of a failed collective (a crash), whose peer may only be slow to claim its own crash: within
#: the settle window, so a lost machine is still named before the window ends
CRASH_SUSPECT_S = 2.5

_FIRST = (Kind.DEADLINE, Kind.LOST_STORE, Kind.LOST_NODE)  # outrank any symptom: nothing to wait for


@dataclass(frozen=True, kw_only=True)
class Poll:
    """What this poll knows beyond the records: ``node`` observes; ``now`` is the monotonic time of
    the poll; ``quiet``: other nodes' agents silent for at least a second, by seconds of silence (the
    liveness verdict); ``lost``: nodes the liveness verdict counts lost; ``held_since``: when the
    settle window of a held symptom began (the previous diagnosis's ``held_since``)."""

    node: int
    now: float
    quiet: Mapping[int, float] = field(default_factory=dict)
    lost: tuple[int, ...] = ()
    held_since: float | None = None
    settle_s: float = SETTLE_S
    suspect_s: float = SUSPECT_S
    crash_suspect_s: float = CRASH_SUSPECT_S


@dataclass(frozen=True)
class Diagnosis:
    """``cause``: the record to claim now (None: nothing to claim this poll); ``why``: how it was
    chosen; ``evidence``: every record the poll produced; ``held_since``: the settle window's start
    while a symptom waits for its cause; ``settle_s``: how long the claimed symptom was held."""

    cause: FaultRecord | None
    why: str = ""
    evidence: tuple[FaultRecord, ...] = ()
    held_since: float | None = None
    settle_s: float | None = None


def _order(r: FaultRecord) -> tuple[int, float, int]:
    return (r.specificity, r.since if r.since is not None else float("inf"), r.rank if r.rank is not None else -1)


def diagnose(evidence: Sequence[FaultRecord], poll: Poll) -> Diagnosis:
    """The one cause of this poll's evidence and the node to blame (see the module doc)."""
    records = tuple(sorted(evidence, key=_order))  # the order they were seen in does not matter
    if not records:
        return Diagnosis(None)
    causes = sorted((r for r in records if r.symptom is None and r.kind is not Kind.COLLECTIVE_WAIT), key=_order)
    if causes and causes[0].kind in _FIRST:
        return Diagnosis(causes[0], f"{causes[0].kind}: outranks every other record", records)
    symptoms = sorted((r for r in records if r.symptom is not None or r.kind is Kind.COLLECTIVE_WAIT), key=_order)
    # a failed collective (a crash) allows a peer's agent a longer silence than a rank idle in a
    # collective does: a machine that is gone is as silent either way, an agent that is only slow
    # (stopped, starved) gets the time to claim its own worker's crash
    crashes_only = all(r.kind in (Kind.EXITED, Kind.KILLED) for r in symptoms)
    gone = _gone(poll, poll.crash_suspect_s if crashes_only else poll.suspect_s)
    if symptoms and gone:
        return Diagnosis(_lost_node(symptoms[0], gone, poll), f"a symptom on node {poll.node} and node(s) "
                         f"{sorted(gone)} silent: the silent node is the cause", records)
    if causes:
        first = causes[0]
        why = f"{first.kind}: the most specific of {len(causes)} cause(s)" + (
            f"; {len(symptoms)} symptom(s) explained by it" if symptoms else "")
        return Diagnosis(first, why, records)
    claimable = [r for r in symptoms if r.kind is not Kind.COLLECTIVE_WAIT]
    if not claimable:
        return Diagnosis(None, "a rank waits in a collective; no peer is silent", records)
    held = [r for r in claimable if r.kind in (Kind.EXITED, Kind.KILLED) or r.evidence.get("suspects")
            or r.evidence.get("waits_for")]
    if not held:  # idle in a collective past the idle limit, no rank stands out: a deadlock, claimed as seen
        return Diagnosis(claimable[0], f"{claimable[0].kind} in a collective and every peer alive: claimed as seen",
                         records)
    since = poll.now if poll.held_since is None else poll.held_since
    waited = poll.now - since
    if waited < poll.settle_s:
        return Diagnosis(None, f"a failed collective, held {waited:.1f}s of {poll.settle_s:g}s for its cause",
                         records, held_since=since)
    first = held[0]  # detected when first seen, not at this poll
    first = replace(first, since=since if first.since is None else min(first.since, since))
    return Diagnosis(first, f"no cause within the {poll.settle_s:g}s settle window: the symptom is claimed",
                     records, held_since=since, settle_s=round(waited, 3))


def _gone(poll: Poll, suspect_s: float) -> dict[int, float]:
    """Other nodes counted lost (silence: infinite) or silent for ``suspect_s``, by silence."""
    out = {n: s for n, s in poll.quiet.items() if n != poll.node and s >= suspect_s}
    out.update({n: float("inf") for n in poll.lost if n != poll.node})
    return out


def _lost_node(symptom: FaultRecord, gone: Mapping[int, float], poll: Poll) -> FaultRecord:
    """The LostNode record a symptom and a silent node make together."""
    node = min(gone, key=lambda n: (-gone[n], n))  # the longest silent, the lowest among equals
    silent = {n: (round(s, 3) if s != float("inf") else None) for n, s in sorted(gone.items())}
    said = ", ".join(f"node {n} silent {s:.1f}s" if s is not None else f"node {n} counted lost"
                     for n, s in silent.items())
    where = f"rank {symptom.rank}" if symptom.rank is not None else f"node {poll.node}"
    # detection latency from the lost node's last sign of life (its last beat), when known
    since = poll.now - gone[node] if gone[node] != float("inf") else symptom.since
    return replace(symptom, kind=Kind.LOST_NODE, reason=Reason.LOST_NODE.value, node=node, rank=None,
                   lost=tuple(sorted(gone)), since=since,
                   detail=f"{said}, while {where} {symptom.symptom or 'waits in a collective'}", symptom=None,
                   evidence={"silent_s": {str(n): s for n, s in silent.items()}, "observed_by": poll.node,
                             "symptom": symptom.summary()})


def odd_ones(waits: Mapping[int, tuple[int, int]]) -> frozenset[int]:
    """The ranks whose wait differs from the majority's (ByteRobust's aggregation of stacks):
    ``waits`` maps each idle rank to ``(code, site)`` (waitsample.py). With three ranks or more
    and one wait shared by more ranks than any other, the ranks not sharing it; else none (two
    ranks, or a tie, name no one)."""
    if len(waits) < 3:
        return frozenset()
    ranked = Counter(waits.values()).most_common()
    top, n = ranked[0]
    if n < 2 or (len(ranked) > 1 and ranked[1][1] == n):
        return frozenset()
    return frozenset(r for r, w in waits.items() if w != top)
