"""Repeat offenders: which nodes to keep out of the next rendezvous while spares can take their place.

HyperPod's ``runPolicy.restartPolicy.maxNumRepeatOffendersToAvoid`` names the knob but its
documentation (the seeds here) does not define it; this is our reading, pure and deterministic
so that every agent computes the same answer from the same history:

- a fault is **attributed** to the node whose group rank its claim names (``node``; a lost node,
  the node of a crashed, hung or NaN rank), by that node's identity (``ranks.identity``:
  ``host:memory root``, the same key ``ranks.py`` claims ranks with), never to the agents that
  only saw it; ``MembershipChange`` and ``Drain`` claims are not faults and are never attributed;
- a node is a **repeat offender** when at least ``threshold`` (2) attributed faults fall within
  ``window_s`` of the newest one (``restartPolicy.evalPeriodSeconds``, the window HyperPod
  uses for ``numRestartBeforeFullJobRestart``; no window: the whole history);
- at most ``max_avoid`` (``maxNumRepeatOffendersToAvoid``) offenders are kept out at once, the
  worst first (most faults, then the most recent, then the identity for a stable order); at a
  process restart never more than there are spares to take their ranks (a job is not shrunk to
  avoid a node, ``exclude``); at a **full job restart** the outer scheduler supplies the nodes,
  so the list is capped by ``max_avoid`` only (``avoid_at_full_restart``): the scheduler is told
  to place the job elsewhere, and the relaunched offender still takes a seat after a bounded
  wait when no other node comes (avoid.py, ``AvoidSettings.wait_s``), so the job never shrinks.

Call order (the agent, through ``avoid.RepeatOffenders``, which keeps the attributed faults in
the job store and agrees on one answer per generation):

    policy = OffenderPolicy.from_restart_policy(run_policy.restart_policy)
    keep_out = policy.exclude(attributed_faults, spares=spares_waiting(store))
    ...an agent whose identity is in keep_out waits at the spare gate instead of rejoining
    avoid = policy.avoid_at_full_restart(attributed_faults)      # at a FULL_RESTART decision
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.launcher.decide.faults import Reason
from tierckpt.launcher.membership.change import MEMBERSHIP_CHANGE

__all__ = ["NodeFault", "OffenderPolicy", "attribute"]


@dataclass(frozen=True)
class NodeFault:
    """One fault attributed to one node: its identity and when the fault was claimed (epoch s)."""

    identity: str
    time: float


def attribute(claims: Sequence[dict[str, Any]], members_at: Sequence[Mapping[int, str]]) -> list[NodeFault]:
    """The faults of ``claims`` (fault records, oldest first) attributed to node identities;
    ``members_at[i]`` is the membership (group rank -> identity) of ``claims[i]``'s generation.
    Claims without a node, membership changes and ranks unknown to the membership are skipped."""
    out = []
    for rec, members in zip(claims, members_at, strict=True):
        node = rec.get("node")
        if rec.get("reason") in (MEMBERSHIP_CHANGE, Reason.DRAIN.value) or node is None or int(node) not in members:
            continue
        out.append(NodeFault(members[int(node)], float(rec["time"])))
    return out


@dataclass(frozen=True, kw_only=True)
class OffenderPolicy:
    """``maxNumRepeatOffendersToAvoid`` as read in the module doc; ``max_avoid`` 0: off."""

    max_avoid: int = 0
    threshold: int = 2
    window_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_avoid, bool) or not isinstance(self.max_avoid, int) or self.max_avoid < 0:
            raise ConfigError(f"maxNumRepeatOffendersToAvoid must be a whole number >= 0, got {self.max_avoid!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int) or self.threshold < 1:
            raise ConfigError(f"the repeat-offender threshold must be at least 1 fault, got {self.threshold!r}")
        if self.window_s is not None and not self.window_s > 0:
            raise ConfigError(f"the repeat-offender window must be more than 0 seconds, got {self.window_s!r}")

    @classmethod
    def from_restart_policy(cls, rsp: Any) -> OffenderPolicy:
        """From a parsed ``restartPolicy`` (``jobspec.RestartPolicy``; None: off)."""
        if rsp is None:
            return cls()
        return cls(max_avoid=rsp.max_num_repeat_offenders_to_avoid or 0, window_s=rsp.eval_period_s)

    def offenders(self, faults: Sequence[NodeFault]) -> list[str]:
        """Every repeat offender's identity, worst first (no cap)."""
        if not faults:
            return []
        newest = max(f.time for f in faults)
        recent = [f for f in faults if self.window_s is None or f.time >= newest - self.window_s]
        counts = Counter(f.identity for f in recent)
        last = {f.identity: f.time for f in sorted(recent, key=lambda f: f.time)}
        found = [ident for ident, n in counts.items() if n >= self.threshold]
        return sorted(found, key=lambda ident: (-counts[ident], -last[ident], ident))

    def exclude(self, faults: Sequence[NodeFault], *, spares: int) -> list[str]:
        """The identities to keep out of the next rendezvous: the worst offenders, at most
        ``max_avoid`` and at most ``spares`` (each needs a spare to take its rank)."""
        if self.max_avoid == 0 or spares <= 0:
            return []
        return self.offenders(faults)[:min(self.max_avoid, spares)]

    def avoid_at_full_restart(self, faults: Sequence[NodeFault]) -> list[str]:
        """The identities the next start of the job should avoid after a full job restart: the
        worst offenders, at most ``max_avoid``; no spare cap (the scheduler supplies the nodes)."""
        if self.max_avoid == 0:
            return []
        return self.offenders(faults)[:self.max_avoid]
