"""Restart decisions: what the launcher does after a fault, as one pure, deterministic function.

Call order: whenever the launcher detects a fault it appends a ``Fault`` to the job's history
(every fault since the last full job restart, oldest first) and calls
``EscalationPolicy.decide(history, full_restarts=..., seed=...)``. Every node computes the same
decision from the same arguments, so the function uses no clock, no environment and no global
random state (jitter comes from ``random.Random`` seeded by ``seed``).

How the HyperPod run policy is read here (its docs do not define the counting; this is ours).
``decide`` looks at the last fault, F, and applies the first rule that matches:

1. **CrashLoop** (FAIL): the last ``crash_loop_limit`` faults, F included, all come from
   generations that died before every worker's first heartbeat and within ``stable_after_s``
   of starting.
2. **NoProgress** (FAIL): the last ``no_progress_limit`` faults, F included, all report a
   ``step`` that is not past their baseline: the larger of the previous fault's ``step`` and
   the fault's own ``resumed_step``. A fault with an unknown ``step``, or with no baseline
   (the first fault of a fresh start), counts as progress and ends the run of such faults.
3. **jobMaxRetryCount** (FAIL): every fault costs one restart, process-level or full. F would be
   restart number ``prior_restarts + len(history)``; if that exceeds ``job_max_retry_count``
   the job fails. So ``jobMaxRetryCount: 3`` allows three restarts and fails on the fourth fault.
4. **numRestartBeforeFullJobRestart** (FULL_RESTART): count the faults whose ``time`` lies in
   ``[F.time - eval_period_s, F.time]``, F included (no ``eval_period_s``: all of history). If
   the count exceeds N, the N process restarts the window allows are used up and F gets a full
   job restart; but if ``full_restarts`` already reached ``max_full_job_restarts``, FAIL.
   N = 2 means: fault 1 and 2 restart processes, fault 3 within the window restarts the job.
5. Otherwise RESTART (process level).

Deadlines (rule 0, before the others): a fault whose reason is ``ActiveDeadline``,
``FaultDeadline`` (raised by ``deadline_fault``) or ``StartupDeadline`` (no first heartbeat and no
log-rule match within ``startupDeadlineSeconds`` of a generation's start) FAILs, as the operator
fails a job that does not start. ``fault_deadline_s``
(``faultDeadlineSeconds``): the job is "in fault" from a fault until a generation recovers
(every worker beat, or it ran ``stable_after_s``: a script that never beats recovers only then);
F FAILs if its restart (after the backoff) would come later than ``fault_deadline_s`` after the
fault that began the period. ``active_deadline_s`` (``activeDeadlineSeconds``): the job's
wall-clock limit, counted from its first start, across full job restarts.

Backoff (RESTART and FULL_RESTART) is for crash loops only. A faulted generation was
**healthy** when it lived ``stable_after_s`` (``time - generation_started``) or trained
``healthy_after_steps`` steps past the step it resumed from (``step - resumed_step``; the launcher
fills ``resumed_step`` with the step before the first one it saw the generation beat, when the
workers did not say). A healthy fault resets the backoff, as Kubernetes resets CrashLoopBackOff
after a healthy run: it restarts at once (delay 0). The unhealthy faults in a row at the end of
the history make a streak; the k-th fault of a streak waits ``backoff_base_s * 2**(k-1)``, capped
at ``backoff_max_s``, times a jitter factor in ``[1 - backoff_jitter, 1 + backoff_jitter]``
(still capped), except that the job's very first fault restarts at once (a streak that starts
there counts one less). The streak survives a full job restart: the restart-state file keeps
``unhealthy_streak`` (``decide``'s ``unhealthy_before``), which the next incarnation's streak
continues when its history holds only unhealthy faults. FAIL has delay 0.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tierckpt.errors import ConfigError, ProtocolError
from tierckpt.launcher.jobspec import RunPolicy

__all__ = ["ACTIVE_DEADLINE", "FAULT_DEADLINE", "STARTUP_DEADLINE", "Action", "Decision", "EscalationPolicy", "Fault", "restarts_before"]

ACTIVE_DEADLINE = "ActiveDeadline"
FAULT_DEADLINE = "FaultDeadline"
STARTUP_DEADLINE = "StartupDeadline"  # the reason heartbeat.py raises
_DEADLINES = {ACTIVE_DEADLINE: "activeDeadlineSeconds", FAULT_DEADLINE: "faultDeadlineSeconds",
              STARTUP_DEADLINE: "startupDeadlineSeconds"}


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One fault of the job; the launcher keeps these job-wide, oldest first."""

    generation: int
    time: float
    generation_started: float
    reason: str
    first_beat: bool
    step: int | None
    resumed_step: int | None

    @property
    def lived_s(self) -> float:
        """How long the faulted generation ran before the fault was detected."""
        return self.time - self.generation_started


class Action(str, enum.Enum):
    RESTART = "restart"
    FULL_RESTART = "full_restart"
    FAIL = "fail"


@dataclass(frozen=True)
class Decision:
    """What to do about a fault. ``reason`` is short and stable; ``detail`` says what to do next."""

    action: Action
    delay_s: float
    reason: str
    detail: str = ""


def _trailing(history: Sequence[Fault], pred: Callable[[int, Fault], bool]) -> int:
    """How many faults at the end of ``history`` satisfy ``pred(index, fault)`` in a row."""
    n = 0
    for i in range(len(history) - 1, -1, -1):
        if not pred(i, history[i]):
            break
        n += 1
    return n


@dataclass(frozen=True, kw_only=True)
class EscalationPolicy:
    """Restart limits and backoff; ``decide`` is the one policy method (see the module docstring).

    Counts of ``None`` are unlimited; a ``crash_loop_limit`` or ``no_progress_limit`` of 0 turns
    that check off.
    """

    job_max_retry_count: int | None = None
    num_restart_before_full_job_restart: int | None = None
    eval_period_s: float | None = None
    max_full_job_restarts: int | None = None
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    backoff_jitter: float = 0.25
    stable_after_s: float = 120.0
    crash_loop_limit: int = 3
    no_progress_limit: int = 3
    #: steps past the resumed step that make a generation healthy (resets the backoff); None or 0:
    #: only ``stable_after_s`` does
    healthy_after_steps: int | None = 10
    fault_deadline_s: float | None = None
    active_deadline_s: float | None = None
    #: the option that set ``job_max_retry_count``, as the exit reason names it (e.g.
    #: ``--max-restarts (default 10)``, ``runPolicy.jobMaxRetryCount 5``); None: ``jobMaxRetryCount (N)``
    job_max_retry_source: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "job_max_retry_count",
            "num_restart_before_full_job_restart",
            "max_full_job_restarts",
            "crash_loop_limit",
            "no_progress_limit",
            "healthy_after_steps",
        ):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(
                    f"escalation.{name} must be a whole number >= 0 (or None for no limit), got {value!r}"
                )
        for name in ("backoff_base_s", "backoff_max_s", "stable_after_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"escalation.{name} must be a finite number of seconds >= 0, got {value!r}")
        for name in ("eval_period_s", "fault_deadline_s", "active_deadline_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"escalation.{name} must be more than zero seconds (or None), got {value!r}")
        if self.backoff_max_s < self.backoff_base_s:
            raise ConfigError(
                f"escalation.backoff_max_s ({self.backoff_max_s}) is below backoff_base_s ({self.backoff_base_s}); raise it"
            )
        if not 0 <= self.backoff_jitter < 1:
            raise ConfigError(
                f"escalation.backoff_jitter must be in [0, 1), e.g. 0.25 for +-25 %, got {self.backoff_jitter!r}"
            )

    @classmethod
    def from_run_policy(cls, rp: RunPolicy, **overrides: Any) -> EscalationPolicy:
        """The policy a job file asks for; ``overrides`` set any field by name (e.g. from argv)."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(
                f"unknown escalation setting(s) {', '.join(unknown)}; known: {', '.join(f.name for f in dataclasses.fields(cls))}"
            )
        rsp = rp.restart_policy
        fields: dict[str, Any] = {"job_max_retry_count": rp.job_max_retry_count,
                                  "fault_deadline_s": rp.fault_deadline_s, "active_deadline_s": rp.active_deadline_s}
        if rsp is not None:
            fields.update(
                num_restart_before_full_job_restart=rsp.num_restart_before_full_job_restart,
                eval_period_s=rsp.eval_period_s,
                max_full_job_restarts=rsp.max_full_job_restarts,
            )
        fields.update(overrides)
        return cls(**fields)

    def backoff_delay(self, consecutive_quick: int, seed: int) -> float:
        """Seconds to wait before the next generation after ``consecutive_quick`` quick faults
        (0 for none); deterministic in ``(consecutive_quick, seed)``."""
        if consecutive_quick <= 0 or self.backoff_base_s == 0:
            return 0.0
        raw = self.backoff_base_s * 2.0 ** min(consecutive_quick - 1, 60)
        raw = min(raw, self.backoff_max_s)
        factor = 1.0 + self.backoff_jitter * (
            2.0 * random.Random(f"{seed}/{consecutive_quick}").random() - 1.0
        )
        return min(raw * factor, self.backoff_max_s)

    def healthy(self, fault: Fault) -> bool:
        """The faulted generation lived ``stable_after_s`` or trained ``healthy_after_steps`` steps
        past its resumed step: a fault after it is no part of a crash loop (resets the backoff)."""
        if fault.lived_s >= self.stable_after_s:
            return True
        n = self.healthy_after_steps
        if not n or fault.step is None or fault.resumed_step is None:
            return False
        return fault.step - fault.resumed_step >= n

    def unhealthy_streak(self, history: Sequence[Fault], unhealthy_before: int = 0) -> int:
        """Unhealthy faults in a row at the end of the job's faults: those of ``history``, plus
        ``unhealthy_before`` (the previous incarnation's streak) when every fault of ``history``
        is unhealthy. The restart-state file keeps it across full job restarts."""
        run = _trailing(history, lambda _, f: not self.healthy(f))
        return run + unhealthy_before if run == len(history) else run

    def consecutive_quick(self, history: Sequence[Fault], *, unhealthy_before: int = 0,
                          prior_restarts: int = 0) -> int:
        """The backoff count of ``history[-1]``: its place in the streak of unhealthy faults
        (0: healthy, restart at once); the job's very first fault does not count."""
        streak = self.unhealthy_streak(history, unhealthy_before)
        first_of_job = prior_restarts == 0 and unhealthy_before == 0 and streak == len(history)
        return max(0, streak - 1) if first_of_job else streak

    def decide(
        self, history: Sequence[Fault], *, full_restarts: int = 0, seed: int = 0, prior_restarts: int = 0,
        unhealthy_before: int = 0,
    ) -> Decision:
        """Decide what to do about ``history[-1]``.

        ``history``: every fault since the last full job restart, oldest first, the last one the
        fault being decided. ``full_restarts``: full job restarts already done (the launcher
        persists it). ``prior_restarts``: restarts done before the last full job restart, so
        ``jobMaxRetryCount`` counts the whole job (0: count this incarnation only).
        ``unhealthy_before``: the streak of unhealthy faults that ended the previous incarnation
        (the restart-state file's ``unhealthy_streak``), so a crash loop across full job restarts
        keeps backing off.
        """
        if not history:
            raise ProtocolError(
                "decide needs the fault being decided as the last entry of history; it was empty"
            )
        last = history[-1]
        if last.reason in _DEADLINES:
            what = _DEADLINES[last.reason]
            return Decision(Action.FAIL, 0.0, f"{what} exceeded",
                            f"{last.reason}: raise {what} in the job file if the job needs longer")
        fail = self._fail_reason(history, prior_restarts)
        if fail is not None:
            return Decision(Action.FAIL, 0.0, *fail)
        delay = self.backoff_delay(self.consecutive_quick(history, unhealthy_before=unhealthy_before,
                                                          prior_restarts=prior_restarts), seed)
        late = self._fault_deadline_passed(history, last.time + delay)
        if late is not None:
            return Decision(Action.FAIL, 0.0, "faultDeadlineSeconds exceeded", late)
        n = self.num_restart_before_full_job_restart
        if n is not None:
            period = self.eval_period_s
            in_window = sum(1 for f in history if period is None or last.time - period <= f.time <= last.time)
            if in_window > n:
                window = f"within evalPeriodSeconds ({period:g})" if period is not None else "in this run"
                reason = f"numRestartBeforeFullJobRestart ({n}) reached {window}"
                limit = self.max_full_job_restarts
                if limit is not None and full_restarts >= limit:
                    return Decision(
                        Action.FAIL,
                        0.0,
                        f"maxFullJobRestarts ({limit}) reached",
                        f"{reason} after {full_restarts} full job restart(s); "
                        f"the last fault was {last.reason}: fix it, or raise maxFullJobRestarts",
                    )
                return Decision(
                    Action.FULL_RESTART,
                    delay,
                    reason,
                    f"{in_window} faults {window}; full job restart {full_restarts + 1}"
                    + (f" of {limit}" if limit is not None else ""),
                )
        done = prior_restarts + len(history)
        of = f" of {self.job_max_retry_count}" if self.job_max_retry_count is not None else ""
        return Decision(Action.RESTART, delay, f"process restart {done}{of}", f"after {last.reason}")

    def fault_period_start(self, history: Sequence[Fault]) -> float | None:
        """When the job's current fault period began: the fault after which no generation recovered
        (each later one died before every worker beat and within ``stable_after_s``); None: no fault."""
        if not history:
            return None
        unrecovered = _trailing(history, lambda _, f: not f.first_beat and f.lived_s < self.stable_after_s)
        return history[max(0, len(history) - 1 - unrecovered)].time

    def _fault_deadline_passed(self, history: Sequence[Fault], restart_at: float) -> str | None:
        start = self.fault_period_start(history)
        limit = self.fault_deadline_s
        if limit is None or start is None or restart_at - start <= limit:
            return None
        return (f"the next restart would come {restart_at - start:.1f}s into the fault period (last fault: "
                f"{history[-1].reason}), past faultDeadlineSeconds ({limit:g}); fix the fault or raise it")

    def deadline_fault(self, now: float, *, job_started: float, history: Sequence[Fault],
                       recovered: bool) -> tuple[str, str] | None:
        """(reason, detail) when a deadline passed at ``now`` (wall clock): the job's
        ``active_deadline_s`` since ``job_started``, or ``fault_deadline_s`` since the current fault
        period began while the job has not ``recovered`` (every worker of the generation beat, or
        it ran ``stable_after_s``). Called by every agent at each poll; the fault it claims FAILs."""
        if self.active_deadline_s is not None and now - job_started >= self.active_deadline_s:
            return ACTIVE_DEADLINE, (f"the job ran {now - job_started:.1f}s since its first start, "
                                     f"activeDeadlineSeconds is {self.active_deadline_s:g}")
        start = self.fault_period_start(history)
        if self.fault_deadline_s is not None and not recovered and start is not None \
                and now - start >= self.fault_deadline_s:
            return FAULT_DEADLINE, (f"not recovered {now - start:.1f}s after the fault ({history[-1].reason}); "
                                    f"faultDeadlineSeconds is {self.fault_deadline_s:g}")
        return None

    def _fail_reason(self, history: Sequence[Fault], prior_restarts: int) -> tuple[str, str] | None:
        last = history[-1]
        loop = _trailing(history, lambda _, f: not f.first_beat and f.lived_s < self.stable_after_s)
        if self.crash_loop_limit and loop >= self.crash_loop_limit:
            return "CrashLoop", (
                f"{loop} generations in a row died before every worker's first heartbeat, each within "
                f"{self.stable_after_s:g}s of starting (last: {last.reason}); read the first failing "
                "worker's output, fix the startup error and start the job again"
            )
        stuck = _trailing(history, lambda i, f: _no_progress(f, history[i - 1] if i > 0 else None))
        if self.no_progress_limit and stuck >= self.no_progress_limit:
            return "NoProgress", (
                f"{stuck} faults in a row without getting past step {last.step} (last: {last.reason}); "
                "the job fails at the same place each time: look at that step's data or state, "
                "or resume from an earlier checkpoint"
            )
        limit = self.job_max_retry_count
        if limit is not None and prior_restarts + len(history) > limit:
            source = self.job_max_retry_source or f"jobMaxRetryCount ({limit})"
            option = source.split(" ", 1)[0]
            return f"{source} reached", (
                f"{prior_restarts + len(history) - 1} restart(s) done; the last fault was {last.reason}: "
                f"fix it, or raise {option}"
            )
        return None


def restarts_before(history: Sequence[Fault]) -> int:
    """Restarts the job made before ``history`` began (``decide``'s ``prior_restarts``).

    The generation counts restarts: each claimed fault moves it by one, a full job restart too,
    and the restart-state file carries it across full job restarts (every node agrees on it at
    the rendezvous). So the first fault of an incarnation's history happened in generation G0
    after G0 restarts, on every node alike, a replacement node included.
    """
    return history[0].generation if history else 0


def _no_progress(fault: Fault, previous: Fault | None) -> bool:
    """True if ``fault`` never got past the previous fault's step or its own resumed step."""
    if fault.step is None:
        return False
    known = [
        s for s in (previous.step if previous is not None else None, fault.resumed_step) if s is not None
    ]
    return bool(known) and fault.step <= max(known)
