"""The node budget over two real gloo ranks sharing one memory root (issue 19, item 5).

Both ranks' slots and steps count against one cap; saves evict the node's own older steps
(the durable ones first) and the memory root never holds more than the budget; the newest
step loads bitwise on both ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tierckpt
from tests.helpers.dist import run_ranks
from tierckpt.node.budget import node_usage_bytes

pytestmark = pytest.mark.slow


def _state(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {f"w{rank}": torch.randn(256, 1024, generator=g)}  # 1 MiB per rank (a key of its own: not deduplicated)


def _save_all(rank: int, memory_dir: str, durable_url: str, budget: int) -> dict:
    cfg = tierckpt.CheckpointConfig(namespace="nb-mp", memory_dir=memory_dir, durable_url=durable_url,
                                    durable_every_n_steps=2, memory_steps_retained=10, node_memory_budget=budget)
    peaks = []
    with tierckpt.Checkpointer(cfg) as ck:
        for step in range(6):
            ck.save(step, _state(step, rank)).result()
            peaks.append(node_usage_bytes(Path(memory_dir)))
        ck.wait()
        memory = sorted(s.step for s in ck.steps() if "memory" in s.tiers)
        out = {f"w{rank}": torch.zeros(256, 1024)}
        loaded = ck.load(out)
        return {"peak": max(peaks), "memory": memory, "loaded": loaded,
                "bitwise": bool(torch.equal(out[f"w{rank}"], _state(5, rank)[f"w{rank}"]))}


def test_two_ranks_share_one_node_budget(shm, durable):
    mem = shm()
    url, _ = durable
    budget = 7 * 2**20  # two ranks x 1 MiB slots: about three steps' worth, headers and metadata included
    results = run_ranks(_save_all, 2, mem, url, budget)
    for res in results:
        assert res["peak"] <= budget
        assert res["loaded"] == 5 and res["bitwise"]
        assert 5 in res["memory"] and len(res["memory"]) < 6  # older steps went to make room
