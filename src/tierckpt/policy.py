"""Policies: tiny values with one pure method each, testable without I/O."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

__all__ = ["DurablePolicy", "RetentionPolicy"]


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest ``keep`` committed steps of a tier (None keeps all), and every protected one.

    ``protected``: steps the node agent listed in the namespace's ``.keep`` (``tierckpt.node.keep``):
    never selected; the newest ``keep`` of the others are kept as well.
    """

    keep: int | None

    def select_for_deletion(self, committed: Sequence[int], protected: Collection[int] = ()) -> list[int]:
        """Steps to delete, oldest first. Never the newest committed step, never a protected one."""
        if self.keep is None:
            return []
        ordered = sorted(set(committed) - set(protected))
        return ordered[: max(0, len(ordered) - max(self.keep, 1))]

    @staticmethod
    def select_for_eviction(committed: Sequence[int], copied: Collection[int] = (),
                            busy: Collection[int] = (), protected: Collection[int] = ()) -> list[int]:
        """Under memory pressure: every step but the newest and the ``busy`` ones (pinned by a
        load or a durable copy), those with a copy elsewhere (``copied``: durable or peer) first,
        oldest first within each group; ``protected`` steps (a peer's replica is at them) last."""
        ordered = sorted(set(committed))[:-1]
        return sorted((s for s in ordered if s not in busy),
                      key=lambda s: (s in protected, s not in copied, s))


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
