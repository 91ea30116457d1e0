"""The node health monitor: runs the checks of health.py every ``interval_s`` on its own thread,
judges them over rounds, reports each change as a ``health`` event and keeps the newest ``Verdict``.

A check fails the node only after ``fail_after`` failing rounds in a row (``judge``, pure): one
flap or one slow answer is no bad node. A check that raises (a bug, not a finding) is reported as a
``warning`` and counts as a warning, never as unhealthy. The monitor decides nothing about the
job: the supervisor reads ``verdict()`` at its polls and drains the node (supervisor/draining.py).

Call order (the supervisor's):

    watch = HealthWatch(build_checks(cfg), events, interval_s=cfg.interval_s, fail_after=cfg.fail_after)
    watch.start()                 # once, before the first round: a ``health`` event lists the checks
    watch.verdict()               # at any poll, from any thread (an immutable value)
    watch.close()                 # at exit
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tierckpt.launcher.detect.health import OK, UNHEALTHY, WARN, Check, CheckResult
from tierckpt.launcher.events import Events, describe_error

__all__ = ["HealthWatch", "Verdict", "judge"]

#: the ``health`` event's status of an unhealthy result before it failed ``fail_after`` rounds
FAILING = "failing"


@dataclass(frozen=True)
class Verdict:
    """The node's health after a round: ``failing`` lists the results that failed ``fail_after``
    rounds in a row (empty: healthy); ``rounds``: rounds run so far."""

    failing: tuple[CheckResult, ...] = ()
    rounds: int = 0

    @property
    def healthy(self) -> bool:
        return not self.failing

    @property
    def checks(self) -> list[str]:
        return sorted({r.check for r in self.failing})

    @property
    def detail(self) -> str:
        return "; ".join(f"command {r.subject!r}: {r.detail}" if r.check == "command" else f"{r.check} {r.detail}"
                         for r in self.failing)


def judge(streaks: Mapping[tuple[str, str], int], results: Sequence[CheckResult],
          fail_after: int) -> tuple[dict[tuple[str, str], int], tuple[CheckResult, ...]]:
    """(the failing streak of each result's key after this round, the results that failed
    ``fail_after`` rounds in a row). A key absent from ``results`` loses its streak."""
    now = {r.key: streaks.get(r.key, 0) + 1 if r.status == UNHEALTHY else 0 for r in results}
    return now, tuple(r for r in results if now[r.key] >= fail_after)


class HealthWatch:
    """See the module doc for the call order."""

    def __init__(self, checks: Sequence[Check], events: Events, *, interval_s: float, fail_after: int,
                 generation: Callable[[], int] = lambda: 0) -> None:
        self.checks = list(checks)
        self.events = events
        self.interval_s = interval_s
        self.fail_after = fail_after
        self._generation = generation  # for the events' ``generation`` field
        self._verdict = Verdict()
        self._streaks: dict[tuple[str, str], int] = {}
        self._shown: dict[tuple[str, str], str] = {}  # the status each key's last event showed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self.checks or self._thread is not None:
            return
        self.events.emit("health", generation=self._generation(), status="watching",
                         checks=[c.describe() for c in self.checks], interval_s=self.interval_s,
                         fail_after=self.fail_after, healthy=True)
        self._thread = threading.Thread(target=self._run, name="tierckpt-health", daemon=True)
        self._thread.start()

    def verdict(self) -> Verdict:
        return self._verdict

    def run_once(self) -> Verdict:
        """One round: every check, the judgement, an event per key whose status changed."""
        results: list[CheckResult] = []
        for check in self.checks:
            try:
                results.extend(check.run())
            except Exception as exc:  # a check's own bug is reported, and never drains a node
                self.events.emit("warning", generation=self._generation(),
                                 what=f"health check {check.describe()} failed to run: {describe_error(exc)}")
                results.append(CheckResult(check.name, check.describe(), WARN, f"could not run: {exc}"))
        self._streaks, failing = judge(self._streaks, results, self.fail_after)
        verdict = Verdict(failing, self._verdict.rounds + 1)
        bad = {r.key for r in failing}
        for r in results:
            status = UNHEALTHY if r.key in bad else FAILING if r.status == UNHEALTHY else r.status
            if self._shown.get(r.key, OK) != status:
                self.events.emit("health", generation=self._generation(), check=r.check, subject=r.subject,
                                 status=status, detail=r.detail, rounds=self._streaks[r.key],
                                 healthy=verdict.healthy)
            self._shown[r.key] = status
        self._verdict = verdict
        return verdict

    def _run(self) -> None:
        while not self._stop.is_set():
            self.run_once()
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
