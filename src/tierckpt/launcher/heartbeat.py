"""Hang and non-finite-loss detection from ``tierckpt.monitor`` heartbeats (pure; time is passed in).

    policy = HeartbeatPolicy(startup_deadline_s=600)          # auto timeout
    tracker = BeatTracker(policy, start=now)                  # one per local rank per generation
    tracker.observe(read_beat(path), now)                     # every monitor interval
    problem = tracker.check(now)                              # None, or (reason, detail)

The timeout tunes itself: before the first beat only ``startup_deadline_s`` applies (none by
default: a script that never beats is never called hung); from the first beat until
``warmup_intervals`` intervals were seen, ``initial_timeout_s``; after that
``max(floor_s, safety_factor x the longest interval seen)``. Intervals are measured on the
launcher's clock when a new record appears, so clock skew between processes does not matter.
A fixed ``--heartbeat-timeout`` replaces the calibrated value.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierckpt.monitor import NON_FINITE_LOSS, Beat

__all__ = ["BeatTracker", "HeartbeatPolicy"]

HANG = "Hang"
STARTUP = "StartupDeadline"


@dataclass(frozen=True, kw_only=True)
class HeartbeatPolicy:
    """How long a rank may go without a heartbeat."""

    fixed_timeout_s: float | None = None
    safety_factor: float = 3.0
    floor_s: float = 5.0
    warmup_intervals: int = 3
    initial_timeout_s: float = 600.0
    startup_deadline_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("fixed_timeout_s", "startup_deadline_s"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        if self.safety_factor < 1 or self.floor_s <= 0 or self.warmup_intervals < 1:
            raise ValueError("safety_factor >= 1, floor_s > 0 and warmup_intervals >= 1 are required")


class BeatTracker:
    """The heartbeat state of one local rank during one generation."""

    def __init__(self, policy: HeartbeatPolicy, start: float) -> None:
        self.policy = policy
        self.start = start
        self.last_seq = 0
        self.last_change: float | None = None
        self.intervals = 0
        self.longest = 0.0
        self.step: int | None = None
        self.loss: float | None = None
        self.non_finite = False

    @property
    def first_beat(self) -> bool:
        return self.last_change is not None

    @property
    def calibrated(self) -> bool:
        return self.intervals >= self.policy.warmup_intervals

    def timeout(self) -> float | None:
        """The current hang timeout in seconds (None: no bound yet)."""
        p = self.policy
        if self.last_change is None:
            return p.startup_deadline_s
        if p.fixed_timeout_s is not None:
            return p.fixed_timeout_s
        if not self.calibrated:
            return p.initial_timeout_s
        return max(p.floor_s, p.safety_factor * self.longest)

    def observe(self, beat: Beat | None, now: float) -> bool:
        """Take the newest record; True when it is new."""
        if beat is None or beat.seq == self.last_seq:
            return False
        if self.last_change is not None:  # start-up and the checkpoint load come before beat 1
            self.longest = max(self.longest, now - self.last_change)
            self.intervals += 1
        self.last_seq = beat.seq
        self.last_change = now
        if beat.step is not None:
            self.step = beat.step
        self.loss = beat.loss
        self.non_finite = self.non_finite or beat.non_finite
        return True

    def check(self, now: float) -> tuple[str, str] | None:
        """(reason, detail) when this rank is faulty now, else None."""
        if self.non_finite:
            return NON_FINITE_LOSS, f"step {self.step}: loss is {self.loss}"
        limit = self.timeout()
        if limit is None:
            return None
        if self.last_change is None:
            if now - self.start > limit:
                return STARTUP, f"no heartbeat within startupDeadlineSeconds ({limit:g}s) of the start"
            return None
        silent = now - self.last_change
        if silent > limit:
            return HANG, f"no heartbeat for {silent:.1f}s (timeout {limit:.1f}s) after step {self.step}"
        return None
