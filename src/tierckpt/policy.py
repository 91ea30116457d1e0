"""Policies: tiny values with one pure method each, testable without I/O."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

__all__ = ["DurablePolicy", "RetentionPolicy"]


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest ``keep`` committed steps of a tier (None keeps all)."""

    keep: int | None

    def select_for_deletion(self, committed: Sequence[int]) -> list[int]:
        """Steps to delete, oldest first. Never the newest committed step."""
        if self.keep is None:
            return []
        ordered = sorted(set(committed))
        return ordered[: max(0, len(ordered) - max(self.keep, 1))]

    @staticmethod
    def select_for_eviction(committed: Sequence[int], copied: Collection[int] = (),
                            busy: Collection[int] = ()) -> list[int]:
        """Under memory pressure: every step but the newest and the ``busy`` ones (pinned by a
        load or a durable copy), those with a copy elsewhere (``copied``: durable or peer) first,
        oldest first within each group."""
        ordered = sorted(set(committed))[:-1]
        return sorted((s for s in ordered if s not in busy), key=lambda s: (s not in copied, s))


@dataclass(frozen=True)
class DurablePolicy:
    """Which saves also go to the durable tier: every N-th step (0 = only when asked)."""

    every_n_steps: int
    has_durable_tier: bool

    def should_save(self, step: int, requested: bool | None) -> bool:
        if not self.has_durable_tier:
            return False
        if requested is not None:
            return requested
        return self.every_n_steps > 0 and step % self.every_n_steps == 0
