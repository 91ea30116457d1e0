"""Collective-free local mode on 2 real gloo ranks with DTensor shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.dist import run_ranks


def _full(step: int) -> torch.Tensor:
    return torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) * (step + 1)


def _local_mode_rank(rank: int, memory_root: str, durable: str, phase: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import tierckpt

    mesh = init_device_mesh("cpu", (2,))
    cfg = tierckpt.CheckpointConfig(namespace="local", memory_dir=memory_root, durable_url=f"file://{durable}",
                                    local_mode=True, durable_every_n_steps=2)
    out: dict = {}
    with tierckpt.Checkpointer(cfg) as ck:
        if phase == "save":
            for step in (1, 2, 3):
                sd = {"w": distribute_tensor(_full(step), mesh, [Shard(0)]), "step": step, "mine": torch.full((3,), float(rank))}
                ck.save(step, sd)
            ck.wait()
        else:
            sd = {"w": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)]), "step": -1, "mine": torch.zeros(3)}
            out["step"] = ck.load(sd)
            out["tiers"] = ck.last_load["tiers"]
            full = sd["w"].full_tensor()
            out["ok"] = torch.equal(full, _full(out["step"])) and sd["step"] == out["step"] \
                and torch.equal(sd["mine"], torch.full((3,), float(rank)))
    dist.barrier()
    return out


@pytest.mark.slow
def test_local_mode_two_ranks(shm_root: Path, durable_dir: Path) -> None:
    run_ranks(_local_mode_rank, 2, str(shm_root), str(durable_dir), "save", timeout=120)
    assert sorted(p.name for p in shm_root.iterdir()) == ["local--rank0", "local--rank1"]
    results = run_ranks(_local_mode_rank, 2, str(shm_root), str(durable_dir), "load", timeout=120)
    assert [r["step"] for r in results] == [3, 3] and all(r["ok"] for r in results)
    assert all(r["tiers"] == ["memory"] for r in results)
    # rank 1 loses its memory tier and step 3 was memory-only: both ranks agree on durable step 2
    import shutil

    shutil.rmtree(shm_root / "local--rank1")
    results = run_ranks(_local_mode_rank, 2, str(shm_root), str(durable_dir), "load", timeout=120)
    assert [r["step"] for r in results] == [2, 2] and all(r["ok"] for r in results)
