"""What a detector saw, as a typed value: ``FaultRecord`` (pure; no clock read, no store).

Each detector of the launcher's poll (process exits, the stopped/idle/busy evidence of silent
ranks, heartbeats, log rules, deadlines, liveness) turns what it saw into one frozen record:

    FaultRecord(kind=Kind.EXITED, reason=Reason.CRASH, rank=1, detail="exit code 1", since=t, ...)

``kind`` says what was observed (a process that exited, a stopped process, a rank waiting in a
collective, an agent gone silent ...); ``reason`` is the fault's name in events, metrics and the
escalation policy (``Crash``, ``Hang``, ``LostNode`` ...). A record with ``symptom`` set is the
visible effect of a failure elsewhere (a rank whose collective failed because its peer died, a
rank blocked in a collective for a peer that is not in it): ``diagnose.diagnose`` looks for its
cause before it names the record itself. Records never leave the node; the claim a node writes to
the store is built from the record ``diagnose`` picks (the agent adds the generation's context).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["SPECIFICITY", "FaultRecord", "Kind", "Reason", "is_log_rule"]


class Reason(str, Enum):
    """The fault names of events, metrics and the escalation policy (log rules add ``Log*_<name>``)."""

    CRASH = "Crash"
    HANG = "Hang"
    NON_FINITE_LOSS = "NonFiniteLoss"
    LOST_NODE = "LostNode"
    LOST_STORE = "LostStore"
    MEMBERSHIP_CHANGE = "MembershipChange"
    STARTUP_DEADLINE = "StartupDeadline"
    ACTIVE_DEADLINE = "ActiveDeadline"
    FAULT_DEADLINE = "FaultDeadline"
    #: not a fault: an unhealthy node leaves for a waiting spare at a step boundary (supervisor/draining.py)
    DRAIN = "Drain"

    def __str__(self) -> str:
        return self.value


def is_log_rule(reason: str) -> bool:
    """``LogHang_<name>``, ``LogSlow_<name>``, ``LogFault_<name>`` (rules.py)."""
    return reason.startswith(("LogHang_", "LogSlow_", "LogFault_"))


class Kind(str, Enum):
    """What a detector observed."""

    DEADLINE = "deadline"          # the job's or the recovery's deadline passed (a policy verdict)
    LOST_STORE = "lost_store"      # the rendezvous store stopped answering
    LOST_NODE = "lost_node"        # another node's agent went silent
    KILLED = "killed"              # a worker ended by a signal
    EXITED = "exited"              # a worker exited non-zero
    STOPPED = "stopped"            # every thread of a worker stopped (SIGSTOP, a debugger)
    NON_FINITE = "non_finite"      # a worker beat a NaN/inf loss
    LOG_RULE = "log_rule"          # a log rule of the job file matched (or its expected line is late)
    STALL = "stall"                # a silent worker: idle, busy past the ceiling, past its section
    COLLECTIVE_WAIT = "collective_wait"  # a silent worker idle in a collective (evidence only: never claimed)
    ARRIVAL = "arrival"            # a new node waits to join (not a fault: no restart counted)

    def __str__(self) -> str:
        return self.value


#: causes by specificity, most specific first (diagnose.py): a lost node or store explains any
#: symptom on the survivors; a process that exited or was killed explains its peers' failed
#: collectives; a stopped process, a non-finite value and a log rule are each their own cause;
#: an unexplained stall comes last. A deadline is a policy verdict on the job and goes first.
SPECIFICITY: tuple[Kind, ...] = (Kind.DEADLINE, Kind.LOST_STORE, Kind.LOST_NODE, Kind.KILLED, Kind.EXITED,
                                 Kind.STOPPED, Kind.NON_FINITE, Kind.LOG_RULE, Kind.STALL,
                                 Kind.COLLECTIVE_WAIT, Kind.ARRIVAL)


@dataclass(frozen=True, kw_only=True)
class FaultRecord:
    """One detector's evidence of a fault on this poll.

    ``node``: the node it blames (None: the node that observed it); ``rank``: the global rank
    (None: no single rank); ``since``: the monotonic time of the last sign of health it saw (the
    detection latency counts from it; None: unknown); ``symptom``: set when the record is the effect
    of a failure elsewhere (the output line or the wait that shows it); ``evidence``: the numbers that
    decided, for the events (JSON values)."""

    kind: Kind
    reason: str
    detail: str
    node: int | None = None
    rank: int | None = None
    step: int | None = None
    since: float | None = None
    symptom: str | None = None
    lost: tuple[int, ...] = ()
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise TypeError(f"FaultRecord.kind must be a Kind, got {self.kind!r}")
        if not self.reason:
            raise ValueError("FaultRecord.reason must be a fault name")

    @property
    def specificity(self) -> int:
        """Its place in ``SPECIFICITY`` (lower: more specific)."""
        return SPECIFICITY.index(self.kind)

    def summary(self) -> dict[str, Any]:
        """The record as the ``fault`` event's ``evidence`` list shows it (JSON values only)."""
        out: dict[str, Any] = {"kind": self.kind.value, "reason": str(self.reason), "detail": self.detail}
        for name in ("node", "rank", "step", "symptom"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.lost:
            out["lost"] = list(self.lost)
        if self.evidence:
            out["evidence"] = dict(self.evidence)
        return out
