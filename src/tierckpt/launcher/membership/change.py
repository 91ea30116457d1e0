"""Membership of a ``tierckpt run`` job: who left, who joined, which spare replaced which node,
and what a membership change costs (nothing: it is not a fault).

Pure functions and dataclasses, no I/O. Call order (the agent):

    got = ranks.exchange_round(...)                        # inside each torch rendezvous round
    before, after = got.memberships()                      # once the round formed (rounds.Rounds.settled)
    change = Change(before=before, after=after)            # after the round
    if change: events.emit("membership", **change.to_event())
    ...on a fault claim:
    history = restart_history(all_claims)                  # MembershipChange and Drain claims removed
    prior = prior_restarts(all_claims)                     # restarts before this incarnation
    plan = shrink(nnodes=..., lost=..., elastic=..., spares_waiting=...)   # regroup or rendezvous

A node is named by its identity, ``host:memory root`` (``ranks.identity``): a relaunched node
with the same memory root is the same node; a spare on another machine (or memory root) is not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.launcher.decide.escalation import Fault, restarts_before
from tierckpt.launcher.decide.faults import Reason

__all__ = ["DRAIN", "MEMBERSHIP_CHANGE", "Change", "Elastic", "Shrink", "missing_nodes", "prior_restarts", "restart_history",
           "shrink"]

#: the claim reason of a node that arrived while the job runs below its maximum (not a fault)
MEMBERSHIP_CHANGE = "MembershipChange"
DRAIN = Reason.DRAIN.value  # not a fault either: no restart counted (supervisor/draining.py)


@dataclass(frozen=True)
class Change:
    """The membership before and after a rendezvous round, group rank -> identity."""

    before: Mapping[int, str]
    after: Mapping[int, str]

    @property
    def left(self) -> list[str]:
        """Identities of the previous round that are not in this one, by their old rank."""
        now = set(self.after.values())
        return [ident for _, ident in sorted(self.before.items()) if ident not in now]

    @property
    def joined(self) -> list[str]:
        """Identities of this round that were not in the previous one, by their new rank."""
        old = set(self.before.values())
        return [ident for _, ident in sorted(self.after.items()) if ident not in old]

    @property
    def replaced(self) -> list[dict[str, Any]]:
        """Ranks whose node left and that a new node (a spare) now holds: ``{node, left, by}``."""
        left, joined = set(self.left), set(self.joined)
        return [{"node": r, "left": self.before[r], "by": ident} for r, ident in sorted(self.after.items())
                if r in self.before and self.before[r] in left and ident in joined]

    def __bool__(self) -> bool:
        return bool(self.before) and (bool(self.left) or bool(self.joined))

    def to_event(self) -> dict[str, Any]:
        """The ``membership`` event's fields (docs/launcher.md)."""
        return {"nnodes_before": len(self.before), "nnodes": len(self.after), "left": self.left,
                "joined": self.joined, "replaced": self.replaced}


@dataclass(frozen=True)
class Elastic:
    """``--nnodes MIN:MAX`` (or the job file's ``elasticPolicy``): how many nodes the job may run on;
    ``allowed`` narrows them (``replicaDiscreteValues``, ``replicaIncrementStep``; empty: every count);
    ``scale_down_wait_s``: how long the survivors of a lost node wait for a node to take its place
    before they shrink the job (``faultyScaleDownTimeoutInSeconds``; 0: at once)."""

    min_nodes: int
    max_nodes: int
    allowed: tuple[int, ...] = ()
    scale_down_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if self.min_nodes < 1 or self.max_nodes < self.min_nodes:
            raise ConfigError(f"--nnodes {self.min_nodes}:{self.max_nodes}: MIN must be at least 1 and MAX at "
                              "least MIN; e.g. --nnodes 2:4")
        if self.allowed and (self.allowed[0] != self.min_nodes or self.allowed[-1] > self.max_nodes
                             or list(self.allowed) != sorted(set(self.allowed))):
            raise ConfigError(f"allowed node counts {list(self.allowed)}: ascending, from MIN ({self.min_nodes}) "
                              f"to at most MAX ({self.max_nodes})")

    @classmethod
    def parse(cls, nnodes: str, allowed: tuple[int, ...] = (), scale_down_wait_s: float = 0.0) -> Elastic:
        """From torchrun's ``--nnodes`` (``N`` or ``MIN:MAX``) and the job file's allowed counts."""
        lo, _, hi = str(nnodes).partition(":")
        try:
            return cls(int(lo), int(hi or lo), allowed, scale_down_wait_s)
        except ValueError:
            raise ConfigError(f"--nnodes {nnodes!r}: give N or MIN:MAX, e.g. --nnodes 2 or --nnodes 2:4") from None

    @property
    def elastic(self) -> bool:
        return self.max_nodes > self.min_nodes

    def allows(self, n: int) -> bool:
        """The job may run on ``n`` nodes."""
        return self.min_nodes <= n <= self.max_nodes and (not self.allowed or n in self.allowed)

    def floor(self, n: int) -> int | None:
        """The most nodes the job may run on with ``n`` available (None: fewer than MIN)."""
        return max((k for k in range(self.min_nodes, min(n, self.max_nodes) + 1) if self.allows(k)), default=None)

    def grows(self, nnodes: int, waiting: int) -> bool:
        """``waiting`` more nodes let a job on ``nnodes`` grow to a count it may run on."""
        return waiting > 0 and (self.floor(nnodes + waiting) or 0) > nnodes


@dataclass(frozen=True)
class Shrink:
    """How the survivors of a lost node go on: ``regroup`` among themselves (no rendezvous round),
    or through torch's rendezvous (a spare or a waiting node can join; too few survivors wait there)."""

    regroup: bool
    survivors: tuple[int, ...]
    why: str
    surplus: tuple[int, ...] = ()  # survivors left out: the allowed count below them (they wait as spares)


def shrink(*, nnodes: int, lost: Sequence[int], elastic: Elastic, spares_waiting: int) -> Shrink:
    """The survivors' plan after ``lost`` group ranks were lost from a job of ``nnodes``.

    Regroup (the survivors agree through the store, renumbered in their old order) when the
    survivors are at least ``min_nodes`` and no spare or waiting node could take a lost rank;
    otherwise torch's rendezvous round, which a spare joins (or which waits for ``min_nodes``).
    Survivors whose count the job may not run on (``Elastic.allowed``) regroup on the largest
    allowed count below it, the lowest group ranks first; the rest are ``surplus``.
    """
    gone = set(lost)
    survivors = tuple(r for r in range(nnodes) if r not in gone)
    if spares_waiting > 0:
        return Shrink(False, survivors, f"{spares_waiting} spare node(s) waiting: a rendezvous round admits one")
    if not gone:
        return Shrink(False, survivors, "no lost node named: a rendezvous round settles the membership")
    keep = elastic.floor(len(survivors))
    if keep is None:
        return Shrink(False, survivors, f"{len(survivors)} survivor(s), below the minimum of {elastic.min_nodes}: "
                      "the rendezvous waits for nodes")
    if keep < len(survivors):  # the job never runs on a count its elasticPolicy forbids: drop to the next one
        return Shrink(True, survivors[:keep], f"{len(survivors)} survivor(s), a node count elasticPolicy does not "
                      f"allow ({list(elastic.allowed)}): regroup on the first {keep}, the others wait as spares",
                      surplus=survivors[keep:])
    return Shrink(True, survivors, f"{len(survivors)} survivor(s) >= {elastic.min_nodes}: regroup without a "
                  "rendezvous round")


def missing_nodes(fault: dict[str, Any], nnodes: int, stopped: int) -> int:
    """How many nodes a re-rendezvous after ``fault`` lacks (the seats a spare may take): the lost
    nodes a ``LostNode`` claim names, else the nodes that did not ack the stop barrier (a machine
    gone with its reaper shows as the survivors' ``Crash``, and the barrier times out)."""
    if fault.get("reason") == "LostNode":
        lost = fault.get("lost") or [fault.get("node")]
        return len({int(n) for n in lost if n is not None}) or 1
    if fault.get("reason") in (MEMBERSHIP_CHANGE, DRAIN):  # a drained node's seat is a kept-out one
        return 0
    return max(0, nnodes - stopped)


def restart_history(history: Sequence[Fault]) -> list[Fault]:
    """The faults that cost a restart: every claim but ``MembershipChange`` (a node arrived) and
    ``Drain`` (an unhealthy node left for a spare)."""
    return [f for f in history if f.reason not in (MEMBERSHIP_CHANGE, DRAIN)]


def prior_restarts(history: Sequence[Fault], membership_changes_before: int = 0) -> int:
    """Restarts done before ``history`` began (``EscalationPolicy.decide``'s ``prior_restarts``).

    The generation moves at every claim, a membership change's included, so the first claim's
    generation counts restarts *and* earlier membership changes; ``membership_changes_before``
    (kept in the restart-state file, agreed in the store) takes the latter out.
    """
    return max(0, restarts_before(history) - membership_changes_before)
