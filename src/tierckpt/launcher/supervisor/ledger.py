"""What one node counts of the job's restarts, and the state file that carries it across a full
job restart: the claimed faults, the restarts in all, the membership changes, the backoff streak,
when the job began, and the escalation decision on that history (decide/escalation.py, pure).

Call order (the supervisor, loop.py):

    Ledger(opts, run_id)
    load() -> RunState                   # before and after each rendezvous round (runstate.py)
    offer(st, ctl)                       # after the round, before JobControl.join (the barrier)
    joined(st, ctl, full_restarts)       # after it: the counts every node agreed on (max of each)
    count(claims); decide(claims, g)     # a fault, after the stop barrier: the same on every node
    tagged(record, g, ctl)               # a local crash that one replacement process may serve (replace.py)
    save(next_generation, full_restarts, ...) -> problem or None   # at every restart and exit
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from tierckpt.launcher.control import keys
from tierckpt.launcher.control.jobcontrol import JobControl
from tierckpt.launcher.decide.escalation import Decision, Fault
from tierckpt.launcher.inprocess.replace import tag
from tierckpt.launcher.membership.change import prior_restarts, restart_history
from tierckpt.launcher.options import RunOptions
from tierckpt.launcher.supervisor import runstate
from tierckpt.launcher.supervisor.runstate import RunState

__all__ = ["Ledger", "fault_of"]


def fault_of(rec: dict[str, Any]) -> Fault:
    """The escalation's view of a claim record (control/jobcontrol.py history)."""
    return Fault(generation=int(rec["generation"]), time=float(rec["time"]),
                 generation_started=float(rec["generation_started"]), reason=str(rec["reason"]),
                 first_beat=bool(rec["first_beat"]), step=rec.get("step"), resumed_step=rec.get("resumed_step"))


class Ledger:
    """One node's restart accounting; see the module doc."""

    def __init__(self, opts: RunOptions, run_id: Callable[[], str]) -> None:
        self.opts = opts
        self._run_id = run_id
        self.full_restarts = 0
        self.job_started = time.time()  # activeDeadlineSeconds counts from here (kept in the state file)
        self.history: list[Fault] = []  # claimed faults of this incarnation, refreshed at each recovery
        self.restarts = 0  # restarts in all, as of the last decision (kept in the state file)
        self.changes_before = 0  # MembershipChange claims of earlier incarnations (kept in the state file)
        self.changes = 0  # ... and of this one, as of the last decision
        self.unhealthy_before = 0  # the backoff streak this incarnation began with (escalation.py; state file)
        self.full_restart_at: float | None = None  # when this incarnation decided a full job restart (state file)
        self.full_restart_at_start: float | None = None  # ... the one before it, read at its first round
        self._joined_once = False

    def load(self) -> RunState:
        return RunState.from_dict(runstate.load(self.opts, self._run_id()))

    def offer(self, st: RunState, ctl: JobControl) -> None:
        """Before the round's join barrier (``JobControl.join``): this node's counts from its state
        file, raised into the job's (the highest any node remembers wins)."""
        ctl.agree_max(keys.MEMBERSHIP_CHANGES, st.membership_changes)
        ctl.agree_max(keys.UNHEALTHY_BEFORE, st.unhealthy_before)

    def joined(self, st: RunState, ctl: JobControl, full_restarts: int) -> None:
        """After the join barrier: the job's start from the state file, and the counts every node
        offered, so every node reads the same (read before the barrier, a node that offered first
        could miss a higher count offered after it, and decide on another history)."""
        self.full_restarts = full_restarts
        if not self._joined_once:  # later rounds of this process read the file it wrote itself
            self._joined_once = True
            self.full_restart_at_start = st.full_restart_at
        if st.job_started is not None:
            self.job_started = min(self.job_started, st.job_started)
        self.changes_before = ctl.get_int(keys.MEMBERSHIP_CHANGES)
        self.unhealthy_before = ctl.get_int(keys.UNHEALTHY_BEFORE)

    def count(self, claims: list[Fault]) -> None:
        """The restart history and the restarts in all as of ``claims`` (kept in the state file);
        ``changes``: the claims that were membership changes (they cost no restart)."""
        self.history = restart_history(claims)
        self.restarts = prior_restarts(claims, self.changes_before) + len(self.history)
        self.changes = len(claims) - len(self.history)

    def decide(self, claims: list[Fault], g: int) -> Decision:
        """The escalation decision on the claims up to generation ``g`` (membership changes cost
        no restart); the same on every node: same history, same seed."""
        return self.opts.escalation.decide(
            restart_history(claims), full_restarts=self.full_restarts,
            prior_restarts=prior_restarts(claims, self.changes_before), unhealthy_before=self.unhealthy_before,
            seed=zlib.crc32(f"{self._run_id()}:{g}".encode()))

    def tagged(self, record: dict[str, Any], g: int, ctl: JobControl) -> dict[str, Any]:
        """A local crash, marked for a replacement alone when the escalation decision (on the
        history as it will be once claimed) restarts (replace.py)."""
        claims = [fault_of(r) for r in ctl.history(g - 1)] + [fault_of(record)]
        return tag(record, replaceable=True, decision=self.decide(claims, g))

    def deadline(self, now: float, *, generation_started: float, all_beat: Callable[[], bool]) -> tuple[str, str] | None:
        """activeDeadlineSeconds / faultDeadlineSeconds (escalation.py) at ``now`` (wall clock); the
        generation counts as recovered once every local rank beat or it ran ``stable_after_s``."""
        pol = self.opts.escalation
        if pol.active_deadline_s is None and pol.fault_deadline_s is None:
            return None
        recovered = all_beat() or now - generation_started >= pol.stable_after_s
        return pol.deadline_fault(now, job_started=self.job_started, history=self.history, recovered=recovered)

    def save(self, next_generation: int, full_restarts: int, *, hang: dict[str, Any], resume_before: int | None,
             offenses: Any, avoid: Sequence[dict[str, Any]]) -> str | None:
        """The state file for the next incarnation (runstate.py); the problem's text when it cannot be written."""
        streak = self.opts.escalation.unhealthy_streak(self.history, self.unhealthy_before) \
            if full_restarts > self.full_restarts else self.unhealthy_before  # the next incarnation's
        state = RunState(next_generation=next_generation, full_restarts=full_restarts, job_started=self.job_started,
                         hang=hang, restarts=self.restarts, resume_before=resume_before,
                         membership_changes=self.changes_before + self.changes, offenses=offenses,
                         avoid=tuple(avoid), unhealthy_before=streak, full_restart_at=self.full_restart_at)
        return runstate.save(self.opts, self._run_id(), state.to_dict())
