"""``dcp.plancache``: DCP's plan cache entries belong to one planner and are dropped on demand.

These pin the torch internals the module relies on (``SavePlanner._cached_*`` keyed by the
planner's ``_cached_plans_key``): a torch that moves them fails here, not in a job.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

from tierckpt.dcp import plancache

_CACHES = ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan",
           "_cached_metadata")


def _save(tmp_path, planner, name: str) -> None:
    sd = {"w": torch.arange(12, dtype=torch.float32), "step": 1}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / name)), planner=planner, no_dist=True)


def _keys(name: str) -> set[str]:
    return set(getattr(SavePlanner, name))


def test_each_planner_caches_under_its_own_key_and_forgets_it(tmp_path) -> None:
    assert plancache.SUPPORTED
    a, b = plancache.CachedSavePlanner(), plancache.CachedSavePlanner()
    assert a.cache_key != b.cache_key
    _save(tmp_path, a, "a1")
    _save(tmp_path, a, "a2")  # the second save takes the cached plans
    _save(tmp_path, b, "b1")
    for name in _CACHES:
        assert {a.cache_key, b.cache_key} <= _keys(name), name
        assert "CachedSavePlanner" not in _keys(name) and "DefaultSavePlanner" not in _keys(name)
    a.forget()
    for name in _CACHES:
        assert a.cache_key not in _keys(name) and b.cache_key in _keys(name), name
    _save(tmp_path, a, "a3")  # plans from scratch again
    assert a.cache_key in _keys("_cached_final_save_plan")
    a.forget()
    b.forget()


def test_clear_all_drops_every_planners_entries(tmp_path) -> None:
    ours, theirs = plancache.CachedSavePlanner(), DefaultSavePlanner(enable_plan_caching=True)
    _save(tmp_path, ours, "ours")
    _save(tmp_path, theirs, "theirs")
    assert {ours.cache_key, "DefaultSavePlanner"} <= _keys("_cached_all_plans")
    plancache.clear_all()
    for name in _CACHES:
        assert _keys(name) == set(), name
