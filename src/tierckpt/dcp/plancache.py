"""DCP's save-plan cache, made safe when ranks come and go: private entries, dropped together.

torch's ``DefaultSavePlanner(enable_plan_caching=True)`` keeps its cached plans in class
attributes of ``SavePlanner`` keyed by the planner's class name: every planner in the process
shares them and they outlive the process group. The cache is right only while every rank of a
save holds matching entries (the coordinator every rank's plans, each rank its own final
plan). A rank replaced alone (a fresh process beside survivors that kept theirs), or a save
that failed after the coordinator cached, breaks that: a rank that finds no entry fails with
``KeyError: 'DefaultSavePlanner'``, or a coordinator without entries hands a survivor an
empty plan (issue 24).

Call order: ``SavePath`` builds one ``CachedSavePlanner`` per ``Checkpointer`` (its entries are
keyed by a key of its own, so a new Checkpointer starts with none on every rank, in a survivor
as in a replacement), calls ``forget`` on every rank after a failed save (a DCP failure
reaches every rank) and at ``close``. ``tierckpt.resilient`` calls ``clear_all`` on every rank
before each generation, which makes a user's own caching planner safe as well. Between those,
a save re-plans either every rank or none, so one save's files always share one save id.

The class attributes are torch internals (2.6+): without them caching is simply off.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

__all__ = ["SUPPORTED", "CachedSavePlanner", "clear_all"]

_CACHES = ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan",
           "_cached_metadata")
#: whether this torch keeps the plan cache where this module expects it; else caching stays off
SUPPORTED = all(isinstance(getattr(SavePlanner, name, None), dict) for name in _CACHES)
_serial = itertools.count()


class CachedSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` with plan caching whose entries belong to this instance alone."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=SUPPORTED)
        self.cache_key = f"tierckpt-{os.getpid()}-{next(_serial)}"
        self._cached_plans_key = self.cache_key  # torch's key for every cache dict (class name by default)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        delta, metadata = super().create_global_plan(all_plans)
        if any(p.usable for p in delta) and not all(p.usable for p in delta):
            # torch re-sends only the ranks whose plan changed; the others would reuse their cached
            # final plan and its storage data (the previous save id): send every rank the new plan
            delta = list(self.global_plan)
        return delta, metadata

    def forget(self) -> None:
        """Drop this planner's entries in this process; the next save plans from scratch."""
        for name in _CACHES if SUPPORTED else ():
            getattr(SavePlanner, name).pop(self.cache_key, None)
        self.__dict__.pop("_pending_local_plan", None)


def clear_all() -> None:
    """Drop every planner's cached plans in this process (each rank, before a new generation)."""
    for name in _CACHES if SUPPORTED else ():
        cache: dict[str, Any] = getattr(SavePlanner, name)
        cache.clear()
