"""Choosing the one step every rank loads: local availability, one all_gather, a pure choice.

Call order (every rank, inside ``TieredStorageReader.read_metadata``):
  ``local_availability(...)`` → ``gather(...)`` (one ``all_gather_object``; skipped without a
  process group) → ``choose_step(...)`` on the gathered list, which every rank evaluates
  identically, so all ranks pick the same step or all raise the same error.
Only rank 0 lists the durable tier, so finding the newest step costs one listing per job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from tierckpt.errors import CheckpointNotFoundError, IntegrityError, NoUsableStepError, StorageError

__all__ = ["UNUSABLE_ADVICE", "Availability", "Choice", "choose_step", "gather"]

#: what to do when committed steps exist but no step is complete for every rank (``NoUsableStepError``)
UNUSABLE_ADVICE = (
    "each rank loads its own shard files, so restart every rank on the node (memory root) that saved "
    "them (tierckpt run keeps a node's ranks across restarts where it can), run `tierckpt run "
    "--replicas 1` so that peer nodes hold copies, or give the job a durable tier (durable_url); "
    "to start over on purpose, use a new namespace"
)



@dataclass(frozen=True)
class Availability:
    """What one rank can read.

    memory   step → files present in this rank's memory tier (committed, sealed manifest)
    files    step → every file the step's manifest lists (known from memory manifests)
    durable  committed durable steps (filled in by rank 0 only)
    bad      step → why this rank's memory copy was rejected
    durable_error  why rank 0 could not list the durable tier (None when it could)
    peer     step → files this rank can fetch from other nodes through its node agent
             (their memory tiers and the replicas they hold; empty without an agent)
    before   this rank's ``resume_before`` (None: no bound); the smallest of all ranks' applies
    """

    rank: int
    memory: Mapping[int, frozenset[str]] = field(default_factory=dict)
    files: Mapping[int, frozenset[str]] = field(default_factory=dict)
    durable: frozenset[int] | None = None
    bad: Mapping[int, str] = field(default_factory=dict)
    durable_error: str | None = None
    peer: Mapping[int, frozenset[str]] = field(default_factory=dict)
    before: int | None = None


@dataclass(frozen=True)
class Choice:
    step: int
    skipped: tuple[tuple[int, str], ...]  # newer steps passed over, with the reason


def gather(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``value`` in rank order (one ``all_gather_object``); ``[value]`` alone."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    world = dist.get_world_size(group)
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def choose_step(
    avail: Sequence[Availability], requested: int | None, *, namespace: str
) -> Choice | None:
    """The newest step every rank can load completely (or ``requested``); None if nothing exists.

    Without ``requested``, only steps older than the smallest ``before`` of any rank (the
    launcher's ``resume_before`` after a non-finite loss) are candidates. A rank can load step S if S is committed in the durable tier, or if its memory tier and
    its peers (other nodes' memory and replicas, through the node agent) together hold every
    file S's manifest lists. An explicit step that exists nowhere →
    CheckpointNotFoundError; one that exists but is not loadable by every rank → IntegrityError.
    Nothing loadable while rank 0 could not list the durable tier → StorageError (never "no
    checkpoint" while a tier that may hold one is unreachable). Steps exist but each lacks some
    rank's files → NoUsableStepError (one with a damaged copy among them → IntegrityError).
    """
    view = _View.of(avail)
    if requested is not None:
        return _choose_requested(view, requested, namespace)
    skipped: list[tuple[int, str]] = []
    limit = view.before
    for step in sorted((s for s in view.seen if limit is None or s < limit), reverse=True):
        reason = view.why_not(step)
        if reason is None:
            return Choice(step, tuple(skipped))
        skipped.append((step, reason))
    view.raise_if_unreachable()
    if skipped and not any(view.damaged(s) for s, _ in skipped):
        raise NoUsableStepError(
            f"namespace {namespace!r} has committed steps {', '.join(map(str, sorted(view.seen)))} "
            f"but none that every rank can load: {'; '.join(f'step {s}: {r}' for s, r in skipped)}. "
            f"Found: {view.holdings()}. To resume: {UNUSABLE_ADVICE}",
            steps=tuple(sorted(view.seen)), missing=dict(skipped),
        )
    if skipped:
        raise IntegrityError(
            f"no step of namespace {namespace!r} can be loaded completely: "
            + "; ".join(f"step {s}: {r}" for s, r in skipped)
        )
    return None


def _choose_requested(view: _View, requested: int, namespace: str) -> Choice:
    if requested not in view.seen:
        view.raise_if_unreachable()
        raise CheckpointNotFoundError(
            f"step {requested} of namespace {namespace!r} does not exist in any tier", step=requested
        )
    reason = view.why_not(requested)
    if reason is not None:
        raise IntegrityError(
            f"step {requested} of namespace {namespace!r} cannot be loaded completely: {reason}", step=requested
        )
    return Choice(requested, ())


@dataclass(frozen=True)
class _View:
    """Every rank's availability merged: what exists anywhere and what each rank lacks."""

    avail: Sequence[Availability]
    durable: frozenset[int]
    durable_error: str | None
    files: Mapping[int, frozenset[str]]
    seen: frozenset[int]
    before: int | None = None  # resume_before: only older steps are candidates (no explicit step)

    @classmethod
    def of(cls, avail: Sequence[Availability]) -> _View:
        durable: frozenset[int] = frozenset()
        durable_error = None
        files: dict[int, frozenset[str]] = {}
        for a in avail:
            if a.durable is not None:
                durable = a.durable
            durable_error = durable_error or a.durable_error
            files.update(a.files)
        seen = set(durable)
        for a in avail:
            seen |= set(a.memory) | set(a.bad) | set(a.peer)
        before = min((a.before for a in avail if a.before is not None), default=None)
        return cls(avail, durable, durable_error, files, frozenset(seen), before)

    def raise_if_unreachable(self) -> None:
        if self.durable_error is not None:
            raise StorageError(
                f"no step can be loaded from memory and the durable tier is unavailable: {self.durable_error}"
            )

    def damaged(self, step: int) -> bool:
        """True when some rank rejected its copy of ``step`` (a checksum or seal problem)."""
        return any(step in a.bad for a in self.avail)

    def holdings(self) -> str:
        """Which rank's memory holds which files of which step, and the durable steps, in words."""
        parts = []
        for a in self.avail:
            held = ", ".join(f"step {s} ({', '.join(sorted(f)) or 'metadata only'})" for s, f in sorted(a.memory.items()))
            peers = f"; its peers: steps {', '.join(map(str, sorted(a.peer)))}" if a.peer else ""
            parts.append(f"rank {a.rank}'s memory tier holds {held or 'nothing'}{peers}")
        parts.append(f"durable tier: steps {', '.join(map(str, sorted(self.durable)))}" if self.durable
                     else "no durable copy")
        return "; ".join(parts)

    def why_not(self, step: int) -> str | None:
        """None when every rank can load ``step`` completely, else the first rank's reason."""
        if step in self.durable:
            return None
        for a in self.avail:
            if step in a.bad:
                return f"rank {a.rank}: {a.bad[step]}"
            own, peers = a.memory.get(step), a.peer.get(step)
            if own is None and peers is None:
                return f"rank {a.rank} has no copy (not in its memory tier, not at peers, not durable)"
            if own is None and step not in self.files:
                return f"rank {a.rank}: no manifest of the step is reachable"
            missing = self.files.get(step, frozenset()) - (own or frozenset()) - (peers or frozenset())
            if missing:
                return (
                    f"rank {a.rank} cannot reach {', '.join(sorted(missing))}: it is only in another "
                    "node's memory tier and the step has no durable copy (run `tierckpt agent` on every "
                    "node with --replicas >= 1, or give the job a durable tier)"
                )
        return None
