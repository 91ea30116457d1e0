"""Two gloo ranks, each its own memory root; rank 1's is a full 4 MiB tmpfs (issue 19, item 6).

Rank 1's memory tier fails; both ranks agree and write the step to the durable tier only, in
one DCP save; both load it back bitwise from there; the earlier step stays in memory.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tierckpt
from tests.helpers.dist import run_ranks

pytestmark = pytest.mark.slow


def _state(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return {f"w{rank}": torch.randn(768, 1024, generator=g)}  # 3 MiB, a key per rank


def _save_and_load(rank: int, memory_dirs: list[str], url: str) -> dict[str, Any]:
    cfg = tierckpt.CheckpointConfig(namespace="fb-mp", memory_dir=memory_dirs[rank], durable_url=url,
                                    durable_every_n_steps=0)
    with tierckpt.Checkpointer(cfg) as ck:
        first = ck.save(1, _state(1, rank))
        first.result()
        second = ck.save(2, _state(2, rank))
        second.result()
        tiers = {s.step: sorted(s.tiers) for s in ck.steps()}
        bitwise = {}
        for step in (2,):
            out = {f"w{rank}": torch.zeros(768, 1024)}
            assert ck.load(out, step=step) == step
            bitwise[step] = (bool(torch.equal(out[f"w{rank}"], _state(step, rank)[f"w{rank}"])),
                             sorted(ck.last_load["tiers"]))
        return {"fallback": [first.fallback, second.fallback], "tiers": tiers, "loaded": bitwise}


def test_one_ranks_full_memory_tier_sends_the_step_to_the_durable_tier(shm, durable, small_tmpfs):
    url, _ = durable
    results = run_ranks(_save_and_load, 2, [shm(), str(small_tmpfs("4m"))], url)
    assert results[0]["fallback"] == [None, "other_rank"]
    assert results[1]["fallback"] == [None, "no_space"]
    for res in results:
        assert res["tiers"] == {1: ["memory"], 2: ["durable"]}
        assert res["loaded"] == {2: (True, ["durable"])}
