"""What a node does after a fault, as a pure plan: ``after_stop(...) -> Plan`` (no store, no clock).

The supervisor's recovery (supervisor/torch_agent.py, ``_recover``) has two halves around the stop
of the local workers. Before it, ``inprocess/replace.route`` decides whether the workers stay (a
rank replaced alone, an in-process restart). After it, every node has acked the stop barrier (or
the barrier gave up), the same escalation ``Decision`` was taken on the same history, and the
repeat offenders to do without are agreed; what remains is which way this node goes:

    FINISH             the decision is not a restart: persist, exit 75 (a full job restart) or fail
    RESTART_IN_PLACE   every node is here and none is kept out: same membership, next generation
    STAND_ASIDE        this node is a repeat offender kept out: it waits at the spare gate
    REGROUP            a node is gone or new: the survivors regroup without a rendezvous round when
                       the job is elastic and enough are left, else a rendezvous round
    RERENDEZVOUS       a node is kept out: a rendezvous round, where a waiting spare takes its rank

``forget_rank``: the others counted this node lost (a partition that healed): it comes back as a
newcomer, through the spare gate, never straight into torch's round (spares.py). ``barrier_all``:
whether the stop barrier waits for every node (not after a lost node or store, a node joining, or
while liveness counts a node lost: those nodes never ack).

Call order: ``barrier_all(reason, lost_now)`` before the stop barrier; ``after_stop(...)`` after it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from tierckpt.launcher.decide.escalation import Action, Decision
from tierckpt.launcher.decide.faults import Reason

__all__ = ["Plan", "Step", "after_stop", "barrier_all"]

_NO_ACK = (Reason.LOST_NODE.value, Reason.MEMBERSHIP_CHANGE.value, Reason.LOST_STORE.value)


class Step(str, Enum):
    FINISH = "finish"
    RESTART_IN_PLACE = "restart"
    STAND_ASIDE = "aside"
    REGROUP = "regroup"
    RERENDEZVOUS = "rendezvous"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Plan:
    """``step``: the way this node goes; ``decision``: the escalation decision it follows;
    ``kept_out``: the seats the kept-out offenders open for spares (the supervisor adds the
    missing nodes it counts on the store); ``forget_rank``: rejoin as a newcomer."""

    step: Step
    decision: Decision
    kept_out: int = 0
    forget_rank: bool = False

    @property
    def rendezvous(self) -> bool:
        """The membership changes: seats open, the spare gate and maybe a round follow."""
        return self.step in (Step.STAND_ASIDE, Step.REGROUP, Step.RERENDEZVOUS)


def barrier_all(reason: str, lost_now: Sequence[int]) -> bool:
    """Whether the stop barrier waits for every node's ack."""
    return reason not in _NO_ACK and not lost_now


def after_stop(claim: Mapping[str, Any], decision: Decision, *, me: int, all_here: bool,
               keep_out: Sequence[int]) -> Plan:
    """The plan after the stop barrier (see the module doc). ``claim``: the fault claimed for the
    generation; ``me``: this node's group rank; ``all_here``: every node acked the stop barrier;
    ``keep_out``: the group ranks the offender policy keeps out (agreed on every node)."""
    if decision.action != Action.RESTART:
        return Plan(Step.FINISH, decision)
    out = tuple(keep_out) if all_here else ()
    if all_here and not out:
        return Plan(Step.RESTART_IN_PLACE, decision)
    if me in out:
        return Plan(Step.STAND_ASIDE, decision, kept_out=len(out))
    lost = claim.get("lost") or [claim.get("node")]
    forget = claim.get("reason") == Reason.LOST_NODE.value and me in lost
    return Plan(Step.RERENDEZVOUS if out else Step.REGROUP, decision, kept_out=len(out), forget_rank=forget)
