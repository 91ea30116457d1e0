"""Hang and non-finite-loss detection from ``tierckpt.monitor`` heartbeats (pure; time is passed in).

    policy = HeartbeatPolicy(startup_deadline_s=600)          # auto timeout
    tracker = BeatTracker(policy, start=now, learned=profile) # one per local rank per generation
    tracker.observe(read_beat(path), now)                     # every monitor interval
    if tracker.wants_sample(now):                             # silent a while: look at the process
        tracker.evidence.add(procwatch.sample_tree(pid, now))
    problem = tracker.check(now, peer_busy=...)               # None, or (reason, detail)
    profile.merge(tracker.profile)                            # before the next generation's trackers

The timeout tunes itself: before the first beat only ``startup_deadline_s`` applies (none by
default: a script that never beats is never called hung; a save's record, ``monitor.saved``,
meets the deadline and counts as the first beat, but a rank that only saves is never timed); from the first beat until
``warmup_intervals`` intervals were seen, ``initial_timeout_s``; after that
``max(floor_s, safety_factor x the longest interval seen)``. Intervals are measured on the
launcher's clock when a new record appears, so clock skew between processes does not matter.
A fixed ``--heartbeat-timeout`` replaces the calibrated value and every other rule.

With ``auto`` (the default) that timeout is only the fallback: once the rank's process has been
sampled while silent, the evidence rules of ``hang.py`` decide (stopped, section deadline,
no CPU or I/O progress, ceiling), so a long evaluation pass is not a hang. What the tracker learns
(``profile``: the longest interval and the longest idle stretch, outside sections) seeds the
next generation's trackers, so a restart does not forget the evaluation pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierckpt.launcher.detect.hang import Evidence, HangPolicy, Profile, judge
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
    hang: HangPolicy = field(default_factory=HangPolicy)

    def __post_init__(self) -> None:
        for name in ("fixed_timeout_s", "startup_deadline_s"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        if self.safety_factor < 1 or self.floor_s <= 0 or self.warmup_intervals < 1:
            raise ValueError("safety_factor >= 1, floor_s > 0 and warmup_intervals >= 1 are required")


class BeatTracker:
    """The heartbeat state of one local rank during one generation."""

    def __init__(self, policy: HeartbeatPolicy, start: float, learned: Profile | None = None) -> None:
        self.policy = policy
        self.start = start
        self.last_seq = 0
        self.last_change: float | None = None
        self.profile = Profile()
        if learned is not None:
            self.profile.merge(learned)
        self.evidence = Evidence(policy.hang)
        self.section: tuple[str, float | None] | None = None  # (name, timeout_s) from the newest record
        self._waited_for_peer = False  # this interval's idleness was excused by a busy rank elsewhere
        self.step: int | None = None
        self.first_step: int | None = None  # the first step seen this generation (its progress starts here)
        self.loss: float | None = None
        self.non_finite = False
        self.saved = False  # a save's record arrived (monitor.saved): the rank started

    @property
    def longest(self) -> float:
        return self.profile.longest_s

    @property
    def intervals(self) -> int:
        return self.profile.intervals

    @property
    def first_beat(self) -> bool:
        """The rank started: it beat, or committed its part of a save."""
        return self.last_change is not None or self.saved

    @property
    def calibrated(self) -> bool:
        return self.first_beat and self.intervals >= self.policy.warmup_intervals

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
        if beat.saved and beat.step is None and self.last_change is None:  # started, never beat: not timed
            self.saved = True
            self.last_seq = beat.seq
            return True
        if self.last_change is not None and self.section is None:  # start-up and the load come before beat 1
            p = self.profile
            p.longest_s = max(p.longest_s, now - self.last_change)
            if not self._waited_for_peer:  # waiting for rank 0's evaluation is no stall of this rank's own
                p.longest_idle_s = max(p.longest_idle_s, self.evidence.max_idle_s)
            p.intervals += 1
        self.evidence.reset()
        self._waited_for_peer = False
        self.section = None if beat.section is None else (beat.section, beat.section_timeout_s)
        self.last_seq = beat.seq
        self.last_change = now
        if beat.step is not None:
            self.step = beat.step
            if self.first_step is None:
                self.first_step = beat.step
        self.loss = beat.loss
        self.non_finite = self.non_finite or beat.non_finite
        return True

    def wants_sample(self, now: float) -> bool:
        """Silent long enough that its process is worth a look (auto mode, after the first beat).

        Every poll at first, then less often as the silence grows (every ``silence / 20``, at most
        1 s apart): a long evaluation pass on many local ranks costs the agent little."""
        if self.policy.fixed_timeout_s is not None or self.last_change is None:
            return False
        silent = now - self.last_change
        s = self.evidence.samples
        return silent >= self.policy.hang.sample_after_s and (not s or now - s[-1].time >= min(1.0, silent / 20))

    def busy_silent(self) -> bool:
        """Silent and computing: a rank the others may be waiting for in a collective."""
        return self.evidence.busy()

    def idle_suspect(self) -> bool:
        """Idle for nearly its idle limit: time to ask whether a rank elsewhere is busy."""
        return self.evidence.known and \
            self.evidence.idle_for() >= self.policy.hang.idle_limit(self.profile) - 2.0

    def stopped(self) -> bool:
        """The rank's process is stopped now (SIGSTOP, a debugger): no in-process restart can reach it."""
        return self.evidence.known and self.evidence.stopped_for() >= self.policy.hang.stopped_s

    def check(self, now: float, *, peer_busy: bool = False, started: bool = False, where: int | None = None,
              peer_user_wait: bool = False, peer_lib_wait: bool = False,
              peer_save_wait: bool = False) -> tuple[str, str] | None:
        """(reason, detail) when this rank is faulty now, else None.

        ``peer_busy``: another rank of the job is silent and busy (hang.py, rule 3). ``started``:
        a log rule matched this rank's output, which meets ``startupDeadlineSeconds`` as a first
        beat does (the deadline is the job's start, by either sign). ``where``, ``peer_user_wait``,
        ``peer_lib_wait``: where this rank and the others wait when idle (hang.judge, rule 3)."""
        if self.non_finite:
            return NON_FINITE_LOSS, f"step {self.step}: loss is {self.loss}"
        limit = self.timeout()
        if limit is None:
            return None
        if self.last_change is None:
            if not (started or self.saved) and now - self.start > limit:
                return STARTUP, (f"no heartbeat and no log-rule match within startupDeadlineSeconds ({limit:g}s) "
                                 "of the start")
            return None
        silent = now - self.last_change
        if self.policy.fixed_timeout_s is None and self.evidence.known:
            self._waited_for_peer = self._waited_for_peer or (peer_busy and self.evidence.idle_for() > 0)
            return judge(self.policy.hang, self.profile, self.evidence, silent_s=silent, step=self.step,
                         section=self.section, peer_busy=peer_busy, where=where,
                         peer_user_wait=peer_user_wait, peer_lib_wait=peer_lib_wait,
                         peer_save_wait=peer_save_wait)
        if self.section is not None and self.section[1] is not None and self.policy.fixed_timeout_s is None:
            limit = max(limit, self.section[1])
        if silent > limit:
            return HANG, f"no heartbeat for {silent:.1f}s (timeout {limit:.1f}s) after step {self.step}"
        return None
