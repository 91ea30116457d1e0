"""Log-rule evaluation with the HyperPod training operator's semantics, sans I/O and sans clock.

Call order: for each attempt (generation) the launcher's shell makes one ``RuleMonitor`` per
monitored stream (one local rank's output) with the attempt's start time, then calls
``feed(line, now)`` for every line and ``check(now)`` on every line and on a ~1 s tick; the
first non-None verdict is a fault. ``pause(now)`` / ``resume(now)`` bracket times when the
workers are stopped, so no timer runs out while nothing can print. Time is always passed in.

Per rule:

- ``stopPattern`` is tried first on each line; a match turns the rule off for the rest of the
  attempt (HEALTHY, nothing else counts). ``logPattern`` is matched with ``re.match`` (from the
  line start, hence the ``.*`` prefixes), as is ``stopPattern``.
- ``expectedStartCutOffInSeconds``: HANGING once more than N s pass after ``start`` without a match.
- ``expectedRecurringFrequencyInSeconds``: after the first match, HANGING once more than N s pass
  without another. It does not cover the time before the first match.
- ``metricThreshold`` + ``operator``: ``float(group(1)) <op> threshold`` is a violation; SLOW after
  ``metricEvaluationDataPoints`` consecutive violating matches; a non-violating match resets the
  count and SLOW goes back to HEALTHY. A metric that is not a finite number ("nan", "inf", a
  group that did not take part, text that does not parse) is a violation: a non-finite metric is
  never healthy. Every match, violating or not, restarts the recurring timer.
- ``faultOnMatch``: FAULTED on the first match, and it stays FAULTED.

A rule's state is the worst that applies: FAULTED > HANGING > SLOW > HEALTHY > WAITING (no match yet).
"""

from __future__ import annotations

import enum
import math
import operator as _op
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tierckpt.launcher.jobspec import LogRule

__all__ = ["RuleMonitor", "RuleState", "Verdict"]

_COMPARE: dict[str, Callable[[float, float], bool]] = {
    "gt": _op.gt,
    "gteq": _op.ge,
    "lt": _op.lt,
    "lteq": _op.le,
    "eq": _op.eq,
}
_SHOWN = 200  # characters of a log line quoted in a verdict


class RuleState(enum.IntEnum):
    """A rule's health; a larger value is worse."""

    WAITING = 0
    HEALTHY = 1
    SLOW = 2
    HANGING = 3
    FAULTED = 4


_PREFIX = {RuleState.SLOW: "LogSlow", RuleState.HANGING: "LogHang", RuleState.FAULTED: "LogFault"}


@dataclass(frozen=True)
class Verdict:
    """An unhealthy rule: ``reason`` is ``LogHang_<name>``, ``LogSlow_<name>`` or ``LogFault_<name>``."""

    state: RuleState
    rule: str
    reason: str
    detail: str


def _quote(line: str) -> str:
    return repr(line if len(line) <= _SHOWN else line[:_SHOWN] + "...")


class _Rule:
    """Mutable evaluation state of one rule; times are on the monitor's paused-adjusted clock."""

    def __init__(self, rule: LogRule) -> None:
        self.rule = rule
        self.stopped = False
        self.last_match: float | None = None
        self.violations = 0
        self.slow_detail = ""
        self.fault_detail = ""

    def feed(self, line: str, t: float) -> None:
        rule = self.rule
        if self.stopped or self.fault_detail:
            return
        if rule.stop_pattern is not None and rule.stop_pattern.match(line):
            self.stopped = True
            return
        m = rule.log_pattern.match(line)
        if m is None:
            return
        self.last_match = t
        if rule.fault_on_match:
            self.fault_detail = f"line matched {rule.log_pattern.pattern!r}: {_quote(line)}"
            return
        if rule.operator is None or rule.metric_threshold is None:
            return
        raw = m.group(1)
        value = _metric(raw)
        if math.isfinite(value) and not _COMPARE[rule.operator](value, rule.metric_threshold):
            self.violations = 0
            return
        self.violations += 1
        self.slow_detail = (
            f"{self.violations} consecutive values {rule.operator} {rule.metric_threshold:g} "
            f"(needs {rule.metric_evaluation_data_points}); last {raw!r} in {_quote(line)}"
        )

    def evaluate(self, t: float, start: float) -> tuple[RuleState, str]:
        rule = self.rule
        if self.stopped:
            return RuleState.HEALTHY, "stopped by stopPattern"
        if self.fault_detail:
            return RuleState.FAULTED, self.fault_detail
        pattern = rule.log_pattern.pattern
        cutoff, every = rule.expected_start_cutoff_s, rule.expected_recurring_frequency_s
        if self.last_match is None:
            if cutoff is not None and t - start > cutoff:
                return RuleState.HANGING, f"no line matched {pattern!r} within {cutoff:g}s of start"
            return RuleState.WAITING, f"no line matched {pattern!r} yet"
        if every is not None and t - self.last_match > every:
            return RuleState.HANGING, (
                f"no line matched {pattern!r} for {t - self.last_match:.0f}s (expected every {every:g}s)"
            )
        if self.violations >= rule.metric_evaluation_data_points:
            return RuleState.SLOW, self.slow_detail
        return RuleState.HEALTHY, f"last matched {t - self.last_match:.0f}s ago"


def _metric(text: str | None) -> float:
    if text is None:
        return math.nan
    try:
        return float(text)
    except ValueError:
        return math.nan


class RuleMonitor:
    """Evaluates rules over the lines of ONE stream (one local rank's output) for one attempt.

    Call order: ``RuleMonitor(rules, start)``, then any interleaving of ``feed``, ``check``,
    ``states``, ``pause`` and ``resume`` with non-decreasing ``now``. ``pause`` while paused and
    ``resume`` while running are no-ops. Lines fed while paused still count (buffered output).
    """

    def __init__(self, rules: Sequence[LogRule], start: float) -> None:
        self._rules = [_Rule(rule) for rule in rules]
        self._start = start
        self._paused_total = 0.0
        self._paused_since: float | None = None

    def _clock(self, now: float) -> float:
        """``now`` minus the time spent paused: the clock every timer runs on."""
        if self._paused_since is not None:
            now = self._paused_since
        return now - self._paused_total

    def feed(self, line: str, now: float) -> None:
        """Evaluate one line (without its trailing newline) seen at ``now``."""
        t = self._clock(now)
        for rule in self._rules:
            rule.feed(line, t)

    def check(self, now: float) -> Verdict | None:
        """The worst unhealthy verdict (SLOW, HANGING or FAULTED) across rules, else None.

        Ties go to the rule listed first.
        """
        t = self._clock(now)
        worst: Verdict | None = None
        for rule in self._rules:
            state, detail = rule.evaluate(t, self._start)
            if state >= RuleState.SLOW and (worst is None or state > worst.state):
                name = rule.rule.name
                worst = Verdict(state, name, f"{_PREFIX[state]}_{name}", detail)
        return worst

    def states(self, now: float) -> dict[str, RuleState]:
        """Each rule's state by name, for status output."""
        t = self._clock(now)
        return {rule.rule.name: rule.evaluate(t, self._start)[0] for rule in self._rules}

    @property
    def matched(self) -> bool:
        """Some rule's ``logPattern`` matched a line: the job has started (``startupDeadlineSeconds``)."""
        return any(rule.last_match is not None for rule in self._rules)

    @property
    def paused(self) -> bool:
        return self._paused_since is not None

    def pause(self, now: float) -> None:
        """Stop every timer at ``now`` (the workers were stopped)."""
        if self._paused_since is None:
            self._paused_since = now

    def resume(self, now: float) -> None:
        """Restart the timers at ``now``; the paused span does not count toward any deadline."""
        if self._paused_since is not None:
            self._paused_total += max(0.0, now - self._paused_since)
            self._paused_since = None
