"""One poll's findings: every detector's evidence as typed records, one diagnosis of them
(decide/diagnose.py), and the claim that names its cause, as the job's store keeps claims.

Call order (the supervisor, loop.py):

    Findings(detectors, events, node_timeout_s)
    arm(local_ranks, outputs) at each start; rearm() after an in-process restart
    every poll: woke(bool) after the wait, then (no claim of another node due)
        detect(result, view, ...) -> the claim to make, or None (nothing, or a symptom held for its cause)
    a fault: record(...) for the claim's fields; the supervisor reads all_beat/progress/nan_step
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

from tierckpt.launcher.control.jobcontrol import Liveness
from tierckpt.launcher.decide.diagnose import Diagnosis, Poll, diagnose
from tierckpt.launcher.decide.faults import FaultRecord, Kind
from tierckpt.launcher.detect.detectors import Detectors
from tierckpt.launcher.events import Events
from tierckpt.launcher.membership.change import MEMBERSHIP_CHANGE
from tierckpt.monitor import NON_FINITE_LOSS

__all__ = ["Findings", "View"]


@dataclass(frozen=True, kw_only=True)
class View:
    """What the supervisor knows of this node at one poll."""

    generation: int
    node: int
    nnodes: int
    ranks: dict[int, int]  # local rank -> global rank
    pids: dict[int, int]  # local rank -> pid
    outputs: tuple[Any, ...] = ()  # the workers' (stderr, stdout) files by local rank
    expired: Any = None  # the file-timer watchdog's expired timers (workers/watchdog.py), if any
    deadline: tuple[str, str] | None = None  # (reason, detail) of a deadline passed (ledger.deadline)
    arrival: bool = False  # an agent waits to join (a MembershipChange)


class Findings:
    """The evidence and diagnosis of each poll; see the module doc."""

    def __init__(self, detectors: Detectors, events: Events, *, node_timeout_s: float) -> None:
        self.detectors = detectors
        self.events = events
        self.node_timeout_s = node_timeout_s
        self.generation_started = time.time()  # wall clock of this generation's start (claims, deadlines)
        self.resumed_step: int | None = None
        self._woke_at: float | None = None  # when a child's exit (SIGCHLD) ended the last wait
        self._held_since: float | None = None  # a symptom's settle window began (decide/diagnose.py)
        self._polled_at = time.monotonic()  # the poll before the current one

    def arm(self, local_ranks: list[int], outputs: tuple[Any, ...]) -> None:
        """A (re)start of the processes: the detectors follow the new ones."""
        self.generation_started = time.time()
        self.detectors.arm(local_ranks, outputs, time.monotonic())
        self._held_since = None

    def rearm(self) -> None:
        """After an in-process restart: the steps went back and paused, as at a start."""
        self.detectors.rearm(time.monotonic())
        self.generation_started = time.time()

    def woke(self, by_exit: bool) -> None:
        """The loop's wait ended; ``by_exit``: a child's exit (SIGCHLD) ended it."""
        self._woke_at = time.monotonic() if by_exit else None

    def detect(self, result: RunResult, view: View, liveness: Liveness | None) -> dict[str, Any] | None:
        """The claim to make at this poll (None: nothing, or a symptom waiting for its cause)."""
        now = time.monotonic()
        lost = liveness.lost() if liveness is not None else []
        records = self.evidence(result, view, liveness, lost, now)
        d = diagnose(records, Poll(node=view.node, now=now, quiet=liveness.quiet() if liveness is not None else {},
                                   lost=tuple(lost), held_since=self._held_since))
        self._held_since = d.held_since
        self._polled_at = time.monotonic()
        return None if d.cause is None else self.claim_of(d, view)

    def evidence(self, result: RunResult, view: View, liveness: Liveness | None, lost: list[int],
                 now: float) -> list[FaultRecord]:
        """What each detector sees at this poll, as typed records (decide/faults.py)."""
        out: list[FaultRecord] = []
        if view.deadline is not None:
            out.append(FaultRecord(kind=Kind.DEADLINE, reason=view.deadline[0], detail=view.deadline[1]))
        det = self.detectors
        if result.state == WorkerState.FAILED:
            # a child's exit wakes the agent (SIGCHLD): detected then; else within the last poll
            out.append(det.crash(result.failures, view.outputs, expired=view.expired,
                                 since=self._woke_at if self._woke_at is not None else self._polled_at))
        else:
            out.extend(det.silent(now, generation=view.generation, nnodes=view.nnodes, ranks=view.ranks,
                                  pids=view.pids))
            self._report_calibration(view.generation)
        if liveness is not None:
            if liveness.store_error is not None:
                out.append(FaultRecord(kind=Kind.LOST_STORE, reason="LostStore", detail=liveness.store_error,
                                       since=now))
            if lost:
                out.append(FaultRecord(kind=Kind.LOST_NODE, reason="LostNode", node=lost[0], lost=tuple(sorted(lost)),
                                       detail=f"agent(s) of node {lost} silent for {self.node_timeout_s:g}s",
                                       since=now - self.node_timeout_s))
        if view.arrival:
            out.append(FaultRecord(kind=Kind.ARRIVAL, reason=MEMBERSHIP_CHANGE,
                                   detail="a new agent is waiting in the rendezvous", since=now))
        return out

    def claim_of(self, d: Diagnosis, view: View) -> dict[str, Any]:
        """The claim of a diagnosis's cause: the claim keys, the diagnosis and its evidence."""
        c = d.cause
        if c is None:
            raise ValueError("a diagnosis without a cause has no claim")
        rec = self.record(str(c.reason), c.rank, c.detail, since=c.since, generation=view.generation,
                          node=view.node if c.node is None else c.node)
        if c.lost:
            rec["lost"] = list(c.lost)
        if c.kind is Kind.STOPPED:
            rec["stopped"] = True  # no in-process restart can reach a stopped process (replace.route)
        if c.symptom is not None:
            rec["symptom"] = c.symptom
        if d.settle_s is not None:
            rec["settle_s"] = d.settle_s
        rec["diagnosis"] = {"cause": c.kind.value, "why": d.why, "evidence": [r.summary() for r in d.evidence]}
        return rec

    def record(self, reason: str, rank: int | None, detail: str, *, since: float | None, generation: int,
               node: int) -> dict[str, Any]:
        """A claim's fields (control/jobcontrol.py keeps them; decide/escalation.py reads them)."""
        now = time.monotonic()
        nan_step = self.nan_step() if reason == NON_FINITE_LOSS else None
        return {
            "generation": generation, "time": time.time(), "generation_started": self.generation_started,
            "reason": reason, "node": node, "rank": rank,
            "detail": detail, "first_beat": self.all_beat(),
            # a non-finite loss: the step of the first non-finite beat seen (a NaN that comes back
            # at that step is no progress, however far the worker ran before the poll); the next
            # generations resume below it
            "step": nan_step if nan_step is not None else self.progress(),
            "resumed_step": self.resumed(),
            "resume_before": nan_step,
            # from the last sign of life (a crash: the SIGCHLD wake-up) to now
            "detection_latency_s": None if since is None else round(max(0.0, now - since), 3),
        }

    def all_beat(self) -> bool:
        """Every local worker of this generation has sent its first heartbeat."""
        return self.detectors.all_beat()

    def progress(self) -> int | None:
        return self.detectors.progress()

    def resumed(self) -> int | None:
        """The step this generation resumed from: the one before the first step any local rank beat
        (escalation.py counts a generation's progress from it)."""
        if self.resumed_step is not None:
            return self.resumed_step
        first = self.detectors.first_step()
        return None if first is None else first - 1

    def nan_step(self) -> int | None:
        """The lowest step at which a local rank beat a non-finite loss this generation, if any."""
        return self.detectors.nan_step()

    def _report_calibration(self, generation: int) -> None:
        fields = self.detectors.calibration()
        if fields is None:
            return
        self.events.hb_timeout.set(fields["heartbeat_timeout_s"])
        self.events.emit("timeout", generation=generation, **fields)
