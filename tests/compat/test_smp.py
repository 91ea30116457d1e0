"""SMP's checkpoint calls (seed 003) on tierckpt, one process: init_optim_state, save/load of a
checkpoint_id on the filesystem, replication groups' topology, and the checks on bad input.
Multi-rank runs (replication groups, another replica count, FSDP1 sharded) are in
``test_smp_ranks.py``; an ``s3://`` checkpoint_id in ``tests/s3/test_compat_smp_s3.py``."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import ConfigError
from tierckpt.compat.smp import (
    DistributedFileSystemReader,
    async_save,
    config_for,
    get_global_ranks,
    init_optim_state,
    load,
    maybe_finalize_async_calls,
    replication_groups,
    save,
)


@pytest.fixture
def memory_root() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tierckpt-smptest-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(path + "-smp", ignore_errors=True)


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))


def _trained(opt_cls: Any, **kw: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = opt_cls(model.parameters(), **kw)
    for i in range(3):
        model(torch.full((4, 6), float(i))).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("opt_cls,kw", [(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
                                        (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}),
                                        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01})])
def test_init_optim_state_creates_every_state_tensor_and_moves_nothing(opt_cls: Any, kw: dict[str, Any]) -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = opt_cls(model.parameters(), **kw)
    assert opt.state_dict()["state"] == {}
    init_optim_state(opt)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # bitwise unchanged
    _, trained = _trained(opt_cls, **kw)
    state, want = opt.state_dict()["state"], trained.state_dict()["state"]
    assert sorted(state) == sorted(want) == [0, 1, 2, 3]
    assert all(sorted(state[i]) == sorted(want[i]) for i in want)
    assert [g["lr"] for g in opt.param_groups] == [kw["lr"]]
    assert all(p.grad is None for p in model.parameters())


def test_init_optim_state_skips_empty_params_when_asked() -> None:
    full, empty = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(0))
    opt = torch.optim.Adam([full, empty], lr=0.1)
    init_optim_state(opt, skip_empty_param=True)
    assert set(opt.state_dict()["state"]) == {0}
    opt2 = torch.optim.Adam([torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(0))], lr=0.1)
    init_optim_state(opt2)
    assert set(opt2.state_dict()["state"]) == {0, 1}


def test_a_checkpoint_id_round_trips_model_and_optimizer_bitwise(tmp_path: Path, memory_root: str) -> None:
    model, opt = _trained(torch.optim.AdamW, lr=1e-2)
    ckpt = tmp_path / "checkpoints" / "tp0_ep0_fsdp0"
    maybe_finalize_async_calls(blocking=True)
    async_save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=str(ckpt),
               coordinator_rank=0, memory_dir=memory_root)
    maybe_finalize_async_calls(blocking=True)
    assert (ckpt / "step_0" / "COMMITTED").exists()  # durable at <dir>/<name>/step_N

    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = {"model": fresh.state_dict()}
    init_optim_state(fresh_opt, skip_empty_param=True)  # the seed's order: model, init, optimizer
    state["optimizer"] = fresh_opt.state_dict()
    load(state, coordinator_rank=0, storage_reader=DistributedFileSystemReader(str(ckpt), memory_dir=memory_root))
    fresh_opt.load_state_dict(state["optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True))
    want, got = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert all(torch.equal(torch.as_tensor(want[i][k]), torch.as_tensor(got[i][k])) for i in want for k in want[i])

    # a second save to the same checkpoint_id is the next step; the durable copy keeps only it
    assert save({"model": fresh.state_dict()}, checkpoint_id=ckpt, memory_dir=memory_root) == 1
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_1"]
    shutil.rmtree(memory_root + "-smp")  # the node's memory is gone: the durable copy answers
    again = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    load(again, storage_reader=DistributedFileSystemReader(ckpt, memory_dir=memory_root))
    assert all(torch.equal(a, b) for a, b in zip(again["model"].values(), model.state_dict().values(), strict=True))


def test_two_checkpoint_ids_with_the_same_last_component_do_not_mix(tmp_path: Path, memory_root: str) -> None:
    a, b = tmp_path / "llama-400steps" / "tp0_ep0_fsdp0", tmp_path / "llama-800steps" / "tp0_ep0_fsdp0"
    save({"w": torch.full((4,), 4.0)}, checkpoint_id=a, memory_dir=memory_root)
    save({"w": torch.full((4,), 8.0)}, checkpoint_id=b, memory_dir=memory_root)
    assert config_for(a, memory_dir=memory_root).memory_dir != config_for(b, memory_dir=memory_root).memory_dir
    got = {"w": torch.zeros(4)}
    load(got, storage_reader=DistributedFileSystemReader(a, memory_dir=memory_root))
    assert torch.equal(got["w"], torch.full((4,), 4.0))


def test_bad_input_is_a_config_error_that_says_what_to_do(tmp_path: Path, memory_root: str) -> None:
    with pytest.raises(ConfigError, match=r"coordinator_rank=1 but DCP coordinates on the group's lowest rank, 0"):
        save({"w": torch.ones(1)}, checkpoint_id=tmp_path / "x", coordinator_rank=1, memory_dir=memory_root)
    with pytest.raises(ConfigError, match=r"its last component is the namespace"):
        config_for(tmp_path / "tp0 ep0")
    with pytest.raises(ConfigError, match=r"needs a bucket and a name"):
        config_for("s3://onlybucket")
    with pytest.raises(ConfigError, match="checkpoint_id is required"):
        save({"w": torch.ones(1)})
    with pytest.raises(ConfigError, match=r"async_save\(\) does not take queue_size"):
        async_save({"w": torch.ones(1)}, checkpoint_id=tmp_path / "x", queue_size=2, memory_dir=memory_root)
    with pytest.raises(ConfigError, match="whole divisor"):
        replication_groups(6, 4)


def test_topology_helpers() -> None:
    assert replication_groups(4, 2) == [[0, 2], [1, 3]]  # replica-major: rank = replica * 2 + shard
    assert replication_groups(4, 4) == [[0], [1], [2], [3]]
    assert get_global_ranks(None) == [0]  # no process group: this process alone
    cfg = config_for("s3://bucket/ckpt/run-7/tp0_ep0_fsdp1", memory_dir="/dev/shm/x")
    assert (cfg.namespace, cfg.durable_url, cfg.durable_steps_retained) == ("tp0_ep0_fsdp1", "s3://bucket/ckpt/run-7", 1)
    assert cfg.memory_dir.startswith("/dev/shm/x-smp/")
