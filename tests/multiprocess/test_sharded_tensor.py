"""ShardedTensor state dicts (what FSDP1's SHARDED_STATE_DICT holds without a device_mesh) on 2 real gloo ranks.

The stager copies each ShardedTensor's local shards into the slot and hands DCP a ShardedTensor with
the same global metadata whose local shards are the slot's views. Saved through ``Checkpointer``
(overlapped and checked, then plain), through ``dcp.save`` and ``dcp.async_save`` with the DCP
plug-ins, and in local mode, all into the memory tier; fresh processes load every step back in place
and compare bitwise. A ShardedTensor of another global size is refused before any byte is read, with
``StateDictMismatchError`` naming the key, as a plain tensor of another shape is.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.state import seeded

pytestmark = pytest.mark.slow

#: key → (global size, dtype, the rank of each chunk along dim 0): "w" one shard per rank, "multi" two
#: per rank (one tensor, several keys in the slot), "tiny" one row (rank 1's shard is empty),
#: "solo" rank 0's alone (rank 1 holds no shard of it)
LAYOUT: dict[str, tuple[tuple[int, ...], torch.dtype, tuple[int, ...]]] = {
    "w": ((10, 6), torch.float32, (0, 1)),
    "multi": ((8, 3), torch.bfloat16, (0, 1, 0, 1)),
    "tiny": ((1, 4), torch.float64, (0, 1)),
    "solo": ((3, 5), torch.int64, (0,)),
}


def _sharded(key: str, step: int, *, zero: bool = False, size: tuple[int, ...] | None = None) -> Any:
    """A ShardedTensor (ChunkShardingSpec on dim 0) whose local shards hold ``seeded(key, step)``'s slices."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    shape, dtype, ranks = LAYOUT[key]
    shape = size or shape
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in ranks])
    st = sharded_tensor.empty(spec, *shape, dtype=dtype)
    full = seeded(key, step, shape, dtype)
    for shard in st.local_shards():
        md = shard.metadata
        part = full[tuple(slice(o, o + n) for o, n in zip(md.shard_offsets, md.shard_sizes, strict=True))]
        shard.tensor.copy_(torch.zeros_like(part) if zero else part)
    return st


def _state(step: int, *, zero: bool = False) -> dict[str, Any]:
    plain = seeded("plain", step, (7,))
    return {
        "model": {key: _sharded(key, step, zero=zero) for key in LAYOUT},
        "plain": torch.zeros_like(plain) if zero else plain,
        "step": -1 if zero else step,
    }


def _holds(sd: dict[str, Any], step: int) -> bool:
    """Whether ``sd`` holds step ``step`` bitwise: every local shard, the plain tensor, the int."""
    want = _state(step)
    for key in LAYOUT:
        got, expect = sd["model"][key].local_shards(), want["model"][key].local_shards()
        if [s.metadata for s in got] != [s.metadata for s in expect]:
            return False
        if not all(torch.equal(g.tensor, e.tensor) for g, e in zip(got, expect, strict=True)):
            return False
    return torch.equal(sd["plain"], want["plain"]) and sd["step"] == step


def _config(ns: str, memory_dir: str, **kw: Any) -> Any:
    import tierckpt

    return tierckpt.CheckpointConfig(namespace=ns, memory_dir=memory_dir, memory_steps_retained=2, **kw)


def _staged_view(rank: int, memory_dir: str) -> dict[str, Any]:
    """What the stager hands DCP: a ShardedTensor with the original's global metadata over slot views."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    import tierckpt

    sd = _state(5)
    with tierckpt.Checkpointer(_config("st-view", memory_dir)) as ck:
        snap = ck.runtime.stager.stage(sd)
        try:
            buf = snap.slot.buffer
            assert buf is not None
            lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
            out = {}
            for key in LAYOUT:
                staged, original = snap.state_dict["model"][key], sd["model"][key]
                shards = staged.local_shards()
                out[key] = {
                    "sharded": type(staged) is ShardedTensor,
                    "same_metadata": staged.metadata() == original.metadata(),
                    "same_values": all(torch.equal(s.tensor, o.tensor) for s, o in zip(shards, original.local_shards(), strict=True)),
                    "in_slot": all(lo <= s.tensor.data_ptr() < hi for s in shards if s.tensor.numel()),
                    "shards": len(shards),
                }
            return out
        finally:
            ck.runtime.stager.release(snap)


def _save(rank: int, memory_dir: str) -> list[list[int]]:
    import torch.distributed.checkpoint as dcp

    import tierckpt

    with tierckpt.Checkpointer(_config("st", memory_dir)) as ck:
        handle = ck.save(1, _state(1), overlap=True, check_snapshot=True)
        handle.wait_staged()
        ck.save(2, _state(2))
        ck.wait()
        listed = [[i.step for i in ck.steps()]]
    cfg = _config("st-dcp", memory_dir)
    dcp.save(_state(3), storage_writer=tierckpt.TieredStorageWriter(cfg, step=3))  # staged from the plan's items
    dcp.async_save(_state(4), storage_writer=tierckpt.TieredStorageWriter(cfg, step=4)).result(timeout=60)
    with tierckpt.Checkpointer(_config("st-local", memory_dir, local_mode=True)) as ck:
        ck.save(6, _state(6))
        ck.wait()
        listed.append([i.step for i in ck.steps()])
    return listed


def _load(rank: int, memory_dir: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import tierckpt

    out: dict[str, Any] = {}
    with tierckpt.Checkpointer(_config("st", memory_dir)) as ck:
        for step in (1, 2):
            sd = _state(0, zero=True)
            out[f"step {step}"] = (ck.load(sd, step=step), ck.last_load["tiers"], _holds(sd, step))
        wrong = _state(0, zero=True)
        wrong["model"]["w"] = _sharded("w", 0, zero=True, size=(12, 6))
        try:
            ck.load(wrong, step=2)
        except tierckpt.StateDictMismatchError as exc:
            out["mismatch"] = str(exc)
        out["mismatch untouched"] = not any(s.tensor.any() for s in wrong["model"]["multi"].local_shards())
    for step in (3, 4):
        sd = _state(0, zero=True)
        reader = tierckpt.TieredStorageReader(_config("st-dcp", memory_dir), step=step)
        dcp.load(sd, storage_reader=reader)
        out[f"step {step}"] = (reader.step, sorted(set(reader.tiers_used.values())), _holds(sd, step))
    with tierckpt.Checkpointer(_config("st-local", memory_dir, local_mode=True)) as ck:
        sd = _state(0, zero=True)
        out["step 6"] = (ck.load(sd), ck.last_load["tiers"], _holds(sd, 6))
    dist.barrier()
    return out


def test_sharded_tensors_stage_save_and_load_bitwise(shm: Any) -> None:
    mem = shm()
    views = run_ranks(_staged_view, 2, mem, timeout=120)
    for rank, by_key in enumerate(views):
        for key, got in by_key.items():
            assert got["sharded"] and got["same_metadata"] and got["same_values"] and got["in_slot"], (rank, key, got)
        assert [by_key[k]["shards"] for k in LAYOUT] == [1, 2, 1, 1 - rank]
    assert run_ranks(_save, 2, mem, timeout=120) == [[[1, 2], [6]]] * 2
    for rank, out in enumerate(run_ranks(_load, 2, mem, timeout=120)):
        for step in (1, 2, 3, 4, 6):
            assert out[f"step {step}"] == (step, ["memory"], True), (rank, step, out[f"step {step}"])
        assert "model.w: checkpoint shape (10, 6), state dict shape (12, 6)" in out["mismatch"]
        assert out["mismatch untouched"]  # refused before any byte was read
