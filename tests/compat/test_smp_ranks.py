"""SMP's multi-rank checkpoints (seed 003) on real gloo ranks: saves per replication group with
the group's ``coordinator_rank``, resumed with another replica count; and FSDP1's
``SHARDED_STATE_DICT`` path (model and ``load_sharded_optimizer_state_dict``) on CPU.

Seed 003 passes ``process_group=`` to ``load_sharded_optimizer_state_dict``; PyTorch's (2.13 here)
takes none (SMP ships its own torch), so the call below leaves it out: the reader carries the group.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_ranks

SHARD = 2


@pytest.fixture
def memory_root() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tierckpt-smpranks-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(path + "-smp", ignore_errors=True)


def _shard(shard_rank: int, version: int) -> dict[str, torch.Tensor]:
    """What SM_LOCAL_STATE_DICT gives a rank: its own shard, the same on every replica of it."""
    g = torch.Generator().manual_seed(100 * version + shard_rank)
    return {"layer.weight": torch.randn(8, 4, generator=g), "layer.bias": torch.randn(8, generator=g)}


def _local_mode_rank(rank: int, save_dir: str, memory_root: str, world: int, version: int, load_version: int | None) -> Any:
    import torch.distributed as dist

    from tierckpt.compat.smp import (
        async_save,
        get_global_ranks,
        load,
        maybe_finalize_async_calls,
        replication_groups,
    )

    # 1. replication ranks and group, as the seed's loop over state.ranker.get_rep_groups()
    current_group, current_ranks = None, None
    for ranks in replication_groups(world, SHARD):
        group = dist.new_group(ranks)
        if rank in ranks:
            current_group, current_ranks = group, ranks
    assert current_ranks is not None and get_global_ranks(current_group) == current_ranks
    coordinator_rank = min(current_ranks)
    shard_rank = rank % SHARD
    checkpoint_id = os.path.join(save_dir, f"tp0_ep0_fsdp{shard_rank}")
    out: dict[str, Any] = {}
    if load_version is not None:
        state = {"model": {k: torch.zeros_like(v) for k, v in _shard(shard_rank, 0).items()}}
        load(state, process_group=current_group, coordinator_rank=coordinator_rank, checkpoint_id=checkpoint_id,
             memory_dir=memory_root)
        want = _shard(shard_rank, load_version)
        out["loaded"] = all(torch.equal(state["model"][k], want[k]) for k in want)
    maybe_finalize_async_calls(blocking=True, process_group=current_group)
    async_save({"model": _shard(shard_rank, version)}, checkpoint_id=checkpoint_id, process_group=current_group,
               coordinator_rank=coordinator_rank, memory_dir=memory_root)
    maybe_finalize_async_calls(blocking=True, process_group=current_group)
    return out


@pytest.mark.slow
def test_replication_groups_save_their_shards_and_resume_with_another_replica_count(tmp_path: Any, memory_root: str) -> None:
    save_dir = str(tmp_path / "checkpoints")
    # 4 ranks = shard degree 2 x 2 replicas: groups [0, 2] and [1, 3], each its own checkpoint_id
    assert run_ranks(_local_mode_rank, 4, save_dir, memory_root, 4, 1, None, timeout=200) == [{}] * 4
    for shard in range(SHARD):
        steps = sorted(p for p in os.listdir(os.path.join(save_dir, f"tp0_ep0_fsdp{shard}")) if p.startswith("step_"))
        assert steps == ["step_0"]
    # 2 ranks = the same shard degree, 1 replica: each group of one loads what a group of two saved;
    # the node's memory is gone first, so it comes from the durable copy; then it saves version 2
    shutil.rmtree(memory_root + "-smp")
    assert run_ranks(_local_mode_rank, 2, save_dir, memory_root, 2, 2, 1, timeout=200) == [{"loaded": True}] * 2
    # and back to 2 replicas: groups of two load what groups of one saved (memory, this node)
    assert run_ranks(_local_mode_rank, 4, save_dir, memory_root, 4, 3, 2, timeout=200) == [{"loaded": True}] * 4


def _fsdp1_rank(rank: int, checkpoint_id: str, memory_root: str, mesh: bool) -> list[bool]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    from tierckpt.compat.smp import (
        DistributedFileSystemReader,
        async_save,
        get_global_ranks,
        init_optim_state,
        load,
        maybe_finalize_async_calls,
    )

    def build(seed: int) -> tuple[Any, Any]:
        from torch.distributed.device_mesh import init_device_mesh

        torch.manual_seed(seed)
        where: dict[str, Any] = {"device_mesh": init_device_mesh("cpu", (2,))} if mesh else {}
        model = FSDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
                     device_id=torch.device("cpu"), use_orig_params=False, **where)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    model, optimizer = build(0)
    for i in range(2):
        model(torch.full((3, 8), float(i + rank))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    process_group = model.process_group
    coordinator_rank = min(get_global_ranks(process_group))
    maybe_finalize_async_calls(blocking=True, process_group=process_group)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        saved = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, optimizer)}
        async_save(saved, checkpoint_id=checkpoint_id, process_group=process_group,
                   coordinator_rank=coordinator_rank, memory_dir=memory_root)
    maybe_finalize_async_calls(blocking=True, process_group=process_group)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        want_model = {k: v.clone() for k, v in model.state_dict().items()}
        want_optim = FSDP.optim_state_dict(model, optimizer)

    fresh, fresh_opt = build(1)
    init_optim_state(fresh_opt)
    reader = DistributedFileSystemReader(checkpoint_id, process_group=process_group, memory_dir=memory_root)
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": fresh.state_dict()}
        load(state_dict, storage_reader=reader, process_group=process_group, coordinator_rank=coordinator_rank)
        fresh.load_state_dict(state_dict["model"])
        optim_state = load_sharded_optimizer_state_dict(model_state_dict=state_dict["model"], optimizer_key="optimizer",
                                                        storage_reader=reader)
        flattened = FSDP.optim_state_dict_to_load(fresh, fresh_opt, optim_state["optimizer"], group=process_group)
        fresh_opt.load_state_dict(flattened)
    with FSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT):
        got_model = fresh.state_dict()
        got_optim = FSDP.optim_state_dict(fresh, fresh_opt)
    dist.barrier()
    same_optim = all(torch.equal(torch.as_tensor(want_optim["state"][fqn][k]), torch.as_tensor(got_optim["state"][fqn][k]))
                     for fqn in want_optim["state"] for k in want_optim["state"][fqn])
    return [all(torch.equal(want_model[k], got_model[k]) for k in want_model), same_optim,
            sorted(want_optim["state"]) == sorted(got_optim["state"]) != []]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [
    pytest.param(True, id="dtensor"),
    pytest.param(False, id="sharded-tensor"),
])
def test_fsdp1_sharded_state_dict_saves_and_loads_model_and_optimizer(tmp_path: Any, memory_root: str, mesh: bool) -> None:
    """Seed 003's sharded path with FSDP1 on CPU (``device_id=cpu``; gloo): with a ``device_mesh``
    FSDP1's SHARDED_STATE_DICT holds DTensors, without one (as in seed 003) ShardedTensors: both
    round-trip bitwise, model and optimizer."""
    checkpoint_id = str(tmp_path / "checkpoints" / "tp0_ep0")
    assert run_ranks(_fsdp1_rank, 2, checkpoint_id, memory_root, mesh, timeout=200) == [[True, True, True]] * 2
    assert os.path.exists(os.path.join(checkpoint_id, "step_0", "COMMITTED"))
