"""Hang evidence beyond the heartbeat: is a silent rank stopped, idle, or busy? (pure; time is passed in)

    policy = HangPolicy()                        # the thresholds (``--hang-ceiling`` sets ceiling_s)
    ev = Evidence()                              # one per local rank per generation (heartbeat.BeatTracker owns it)
    ev.add(sample)                               # each poll while the rank is silent (procwatch.sample_tree)
    ev.reset()                                   # at each new heartbeat (after reading ev.max_idle_s)
    judge(policy, profile, ev, silent_s=..., step=..., section=..., peer_busy=...)  # None or (reason, detail)

A heartbeat that is late is not yet a hang. What decides, in this order:

1. **stopped**: every thread of the rank's process has been stopped (state ``T``/``t``: SIGSTOP,
   a stopped debugger) for ``stopped_s`` (3 s) → ``Hang``.
2. **section**: inside ``monitor.section(name, timeout_s=...)`` the rank may be silent until the
   section's own deadline, whatever it does; past it → ``Hang``.
3. **idle**: the rank's process tree made no progress (under ``idle_cpu_fraction`` of one core, under
   ``idle_io_bytes_per_s`` read or written (sockets and pipes count: a data loader waiting on
   a remote bucket moves bytes, a collective that never returns does not), no thread runnable
   or in uninterruptible I/O in more than a quarter of the samples) for the idle
   limit, ``max(idle_floor_s, idle_factor x the longest idle stretch learned)`` → ``Hang``, unless
   another rank of the job is busy and silent too (this one waits for that one in a collective).
   A busy rank that gets little CPU because the machine is loaded stays runnable (``R``), so it
   never looks idle. Where the idle rank's main thread waits (``where``, from tierckpt.waitsample)
   names the culprit: idle in its own code while a rank waits in a collective → this rank's
   ``Hang``; idle in a collective while a rank is idle in its own code → not this one's; every
   rank idle in its own code (an evaluation waiting on a service) → no hang before the ceiling;
   idle in a tierckpt save, load or wait (``SAVE``: storage I/O, an S3 throttling backoff), or in a
   collective while a rank is → no hang before the ceiling either.
4. **ceiling**: a rank that keeps computing without a heartbeat is a hang after ``ceiling_s``, or
   ``max(ceiling_floor_s, ceiling_factor x the longest interval learned)`` (a livelock, a loop
   that never ends).

Evaluation passes, synchronous saves, recompilations and data-loader stalls keep the process
busy (or in I/O, or waiting for a busy peer), so they are never called hangs before the
ceiling. Without evidence (no ``/proc``, no sample yet) the beat-only timeout applies.
What is learned (``Profile``) survives restarts: the agent keeps it and the restart-state file
persists it (``supervisor/runstate.py``, key ``hang``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tierckpt.waitsample import LIB as LIB_WAIT
from tierckpt.waitsample import SAVE as SAVE_WAIT
from tierckpt.waitsample import USER as USER_WAIT

__all__ = ["LIB_WAIT", "SAVE_WAIT", "USER_WAIT", "Evidence", "HangPolicy", "Profile", "Sample", "judge"]

HANG = "Hang"


@dataclass(frozen=True, kw_only=True)
class HangPolicy:
    """Thresholds of the evidence rules (seconds unless named otherwise)."""

    stopped_s: float = 3.0
    idle_floor_s: float = 5.0
    idle_factor: float = 2.0
    idle_cpu_fraction: float = 0.02
    idle_io_bytes_per_s: float = 4096.0
    ceiling_s: float | None = None
    ceiling_floor_s: float = 300.0
    ceiling_factor: float = 10.0
    sample_after_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("stopped_s", "idle_floor_s", "ceiling_floor_s", "sample_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HangPolicy.{name} must be positive, got {getattr(self, name)}")
        if self.ceiling_s is not None and not (math.isfinite(self.ceiling_s) and self.ceiling_s > 0):
            raise ValueError(f"--hang-ceiling must be positive seconds, got {self.ceiling_s}")
        if self.idle_factor < 1 or self.ceiling_factor < 1 or not 0 < self.idle_cpu_fraction < 1:
            raise ValueError("idle_factor >= 1, ceiling_factor >= 1 and 0 < idle_cpu_fraction < 1 are required")

    def idle_limit(self, profile: Profile) -> float:
        return max(self.idle_floor_s, self.idle_factor * profile.longest_idle_s)

    def ceiling(self, profile: Profile) -> float:
        if self.ceiling_s is not None:
            return self.ceiling_s
        return max(self.ceiling_floor_s, self.ceiling_factor * profile.longest_s)


@dataclass
class Profile:
    """What a job's ranks were seen to do between heartbeats (outside sections); kept across restarts."""

    longest_s: float = 0.0
    longest_idle_s: float = 0.0
    intervals: int = 0

    def merge(self, other: Profile) -> None:
        self.longest_s = max(self.longest_s, other.longest_s)
        self.longest_idle_s = max(self.longest_idle_s, other.longest_idle_s)
        self.intervals = max(self.intervals, other.intervals)

    def to_dict(self) -> dict[str, float]:
        return {"longest_s": round(self.longest_s, 3), "longest_idle_s": round(self.longest_idle_s, 3),
                "intervals": self.intervals}

    @classmethod
    def from_dict(cls, raw: Any) -> Profile:
        """The persisted form; anything malformed is an empty profile (learning starts over)."""
        try:
            p = cls(longest_s=float(raw["longest_s"]), longest_idle_s=float(raw["longest_idle_s"]),
                    intervals=int(raw["intervals"]))
        except (TypeError, KeyError, ValueError):
            return cls()
        ok = all(math.isfinite(v) and v >= 0 for v in (p.longest_s, p.longest_idle_s)) and p.intervals >= 0
        return p if ok else cls()


@dataclass(frozen=True)
class Sample:
    """One look at a rank's process tree (procwatch.sample_tree)."""

    time: float  # the launcher's monotonic clock
    cpu_s: float  # utime + stime of the rank's process and its live descendants
    stopped: bool  # every thread of the rank's own process is stopped (T/t)
    active: bool  # some thread of the tree is runnable (R) or in uninterruptible I/O (D)
    io_bytes: int = 0  # rchar + wchar of the tree (/proc/<pid>/io): files, sockets, pipes


class Evidence:
    """The samples of one rank since its last heartbeat, and what they show."""

    def __init__(self, policy: HangPolicy | None = None) -> None:
        self.policy = policy or HangPolicy()
        self.samples: list[Sample] = []
        self._active: list[int] = []  # how many of samples[:i + 1] are active (prefix sums)
        self.max_idle_s = 0.0  # the longest idle stretch since the last heartbeat

    def reset(self) -> None:
        self.samples.clear()
        self._active.clear()
        self.max_idle_s = 0.0

    def add(self, sample: Sample) -> None:
        last = self.samples[-1] if self.samples else None
        if last is not None and (sample.cpu_s < last.cpu_s or sample.io_bytes < last.io_bytes):
            # a child died: its counters left the sums; rebase the earlier samples
            dc, dio = max(0.0, last.cpu_s - sample.cpu_s), max(0, last.io_bytes - sample.io_bytes)
            self.samples = [Sample(s.time, s.cpu_s - dc, s.stopped, s.active, s.io_bytes - dio) for s in self.samples]
        self.samples.append(sample)
        self._active.append((self._active[-1] if self._active else 0) + sample.active)
        if len(self.samples) > 20_000:  # ~30 min at 0.1 s: the start is no longer needed
            half = len(self.samples) // 2
            del self.samples[:half]
            del self._active[:half]
        self.max_idle_s = max(self.max_idle_s, self.idle_for())

    @property
    def known(self) -> bool:
        return len(self.samples) >= 2

    def stopped_for(self) -> float:
        """How long the trailing run of stopped samples lasts (0: the last sample is not stopped)."""
        s = self.samples
        if not s or not s[-1].stopped:
            return 0.0
        i = len(s) - 1
        while i > 0 and s[i - 1].stopped:
            i -= 1
        return s[-1].time - s[i].time

    def idle_for(self) -> float:
        """The longest trailing stretch without CPU progress (see the module doc's rule 3)."""
        s, n = self.samples, len(self.samples)
        if n < 2:
            return 0.0
        last, best = s[-1], 0.0
        stride = max(1, n // 256)  # a long silence is judged on ~256 windows, not every sample
        before = 0
        for i in range(n - 2, -1, -stride):
            span = last.time - s[i].time
            if last.cpu_s - s[i].cpu_s > self.policy.idle_cpu_fraction * span + 0.02 or \
                    last.io_bytes - s[i].io_bytes > self.policy.idle_io_bytes_per_s * span + 4096:  # 2 ticks, a page
                break
            before = self._active[i - 1] if i else 0
            if self._active[-1] - before <= 0.25 * (n - i):
                best = span
        return best

    def busy(self) -> bool:
        """Making progress now: the last second or so is not idle, and the process is not stopped."""
        return self.known and not self.samples[-1].stopped and self.idle_for() < 1.0


def judge(policy: HangPolicy, profile: Profile, ev: Evidence, *, silent_s: float, step: int | None,
          section: tuple[str, float | None] | None = None, peer_busy: bool = False,
          where: int | None = None, peer_user_wait: bool = False,
          peer_lib_wait: bool = False, peer_save_wait: bool = False) -> tuple[str, str] | None:
    """(reason, detail) when the evidence shows a hang now, else None; the caller checks ``ev.known`` first.

    ``where``: where the rank's main thread waits (waitsample.USER / LIB; None: unknown);
    ``peer_user_wait`` / ``peer_lib_wait``: another rank of the job is idle in its own code / in
    torch (a collective). Rule 3 then names the culprit: a rank idle in its own code is the stall
    when a rank waits for it in a collective, and no hang before the ceiling when none does (an
    evaluation pass that waits on a service); a rank idle in a collective while another is idle in
    its own code waits for that one (not its hang)."""
    after = f"{silent_s:.1f}s after its last heartbeat at step {step}"
    stopped = ev.stopped_for()
    if stopped >= policy.stopped_s:
        return HANG, f"process stopped (state T) for {stopped:.1f}s, {after}"
    if section is not None and section[1] is not None:
        name, limit = section[0], section[1]
        if silent_s > limit:
            return HANG, f"in section {name!r} for {silent_s:.1f}s, past its timeout_s={limit:g} (step {step})"
        return None
    idle, idle_limit = ev.idle_for(), policy.idle_limit(profile)
    if silent_s >= idle_limit and idle >= idle_limit - policy.sample_after_s - 0.5 and not peer_busy:
        if where == USER_WAIT and peer_lib_wait:
            return HANG, (f"idle in its own code for {idle:.1f}s, {after}, while rank(s) wait for it in a "
                          f"collective (idle limit {idle_limit:.1f}s)")
        if where == LIB_WAIT and peer_user_wait:
            return None  # it waits for a rank stalled in its own code: that rank is the one reported
        # waiting for a rank whose checkpoint save waits on storage (S3 throttling): the ceiling decides
        if where not in (USER_WAIT, SAVE_WAIT) and not (where == LIB_WAIT and peer_save_wait):
            return HANG, (f"no CPU or I/O progress for {idle:.1f}s, {after} (idle limit {idle_limit:.1f}s; "
                          "no other rank busy)")
    ceiling = policy.ceiling(profile)
    if silent_s >= ceiling:
        what = "busy" if ev.busy() else ("waiting for a busy rank" if peer_busy else
                                         "idle in its own code" if where == USER_WAIT else
                                         "waiting on a checkpoint's storage" if where == SAVE_WAIT else
                                         "not idle long enough")
        return HANG, f"no heartbeat for {silent_s:.1f}s while {what} (ceiling {ceiling:.0f}s), step {step}"
    return None
