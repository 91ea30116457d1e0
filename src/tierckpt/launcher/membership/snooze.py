"""``restartPolicy.scaleUpSnoozeTimeInSeconds``: no scale-up right after the job scaled down.

HyperPod's documentation (the seeds and research/anchors-resilience.md) names the field, default
0, for elastic jobs, without more; our reading: after a round or regroup that left the job with
fewer nodes than before (a scale-down), the running agents do not claim a ``MembershipChange``
for a node that arrived (torch's wait list, ``spares.arrivals``) until ``snooze_s`` have passed;
the arriving node waits in the rendezvous meanwhile and is admitted at the first poll after.
Pure; the agent passes its monotonic clock.

Call order (``TierckptAgent``):

    snooze = ScaleUpSnooze.from_restart_policy(run_policy.restart_policy)
    if scaled_down(change): down_at = time.monotonic()          # after each round or regroup
    if snooze.allows(time.monotonic(), down_at) and <a node waits>: claim MembershipChange
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.launcher.membership.change import Change

__all__ = ["ScaleUpSnooze", "scaled_down"]


def scaled_down(change: Change) -> bool:
    """The round ``change`` describes left the job with fewer nodes than the one before it."""
    return bool(change.before) and len(change.after) < len(change.before)


@dataclass(frozen=True, kw_only=True)
class ScaleUpSnooze:
    """How long after a scale-down a scale-up waits (0: not at all)."""

    snooze_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.snooze_s >= 0:
            raise ConfigError(f"scaleUpSnoozeTimeInSeconds must be zero or more seconds, got {self.snooze_s!r}")

    @classmethod
    def from_restart_policy(cls, rsp: Any) -> ScaleUpSnooze:
        """From a parsed ``restartPolicy`` (``jobspec.RestartPolicy``; None: no snooze)."""
        return cls(snooze_s=float(getattr(rsp, "scale_up_snooze_time_s", None) or 0.0))

    def allows(self, now: float, scaled_down_at: float | None) -> bool:
        """A scale-up may start at ``now`` (the job never scaled down, or long enough ago)."""
        return scaled_down_at is None or now - scaled_down_at >= self.snooze_s
