"""When an unhealthy node leaves: a pure decision (no clock read, no store) on the health verdict,
the spares waiting at the gate and the node's newest step boundary.

An unhealthy node (its health checks failed ``--health-fail-after`` rounds in a row) with a spare
waiting leaves at the next **step boundary**: once a step newer than the one it held when the
wait began is committed in its memory tier (and replicated, where its node agent replicates), so
the spare resumes at the newest step and nothing trained is lost. A job that saves rarely does not
keep a sick node for long: after ``wait_s`` it leaves anyway (the spare resumes at the last step
committed). With no spare waiting it stays and is reported; it leaves as soon as one arrives.

Call order (supervisor/draining.py, at each poll while the node is unhealthy):

    policy = DrainPolicy(wait_s=cfg.drain_wait_s)
    step, why = policy.next_step(healthy=..., spares=..., waiting_since=..., boundary_then=...,
                                 boundary_now=..., now=...)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from tierckpt.errors import ConfigError

__all__ = ["DrainPolicy", "DrainStep"]


class DrainStep(str, Enum):
    STAY = "stay"      # healthy: nothing to do
    REPORT = "report"  # unhealthy, no spare waits: report it, keep training (kept out at the next restart)
    WAIT = "wait"      # unhealthy, a spare waits: wait for the next step boundary
    DRAIN = "drain"    # leave now: claim the drain

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True)
class DrainPolicy:
    """``wait_s``: the longest wait for a step boundary once a spare waits."""

    wait_s: float = 120.0

    def __post_init__(self) -> None:
        if not (isinstance(self.wait_s, (int, float)) and math.isfinite(self.wait_s) and self.wait_s > 0):
            raise ConfigError(f"--health-drain-wait must be more than 0 seconds, got {self.wait_s!r}")

    def next_step(self, *, healthy: bool, spares: int, waiting_since: float | None, boundary_then: int | None,
                  boundary_now: int | None, now: float) -> tuple[DrainStep, str]:
        """(what to do, why). ``waiting_since``: when this node began waiting for a boundary (None:
        it does not wait yet); ``boundary_then``/``boundary_now``: the newest step boundary then and
        now (None: none seen)."""
        if healthy:
            return DrainStep.STAY, "healthy"
        if spares <= 0:
            return DrainStep.REPORT, "no spare waits to take this node's rank"
        if waiting_since is None:
            return DrainStep.WAIT, f"a spare waits: leaving at the next step boundary (within {self.wait_s:g}s)"
        if boundary_now is not None and (boundary_then is None or boundary_now > boundary_then):
            return DrainStep.DRAIN, f"step {boundary_now} committed"
        if now - waiting_since >= self.wait_s:
            return DrainStep.DRAIN, (f"no new step committed within {self.wait_s:g}s (--health-drain-wait); "
                                     f"the spare resumes at step {boundary_now}")
        return DrainStep.WAIT, "waiting for the next step boundary"
