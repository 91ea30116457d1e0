"""The tree codec under the Lightning plug-in: any nested checkpoint object, saved and loaded whole."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt import CheckpointConfig, Checkpointer, CheckpointNotFoundError, StateDictMismatchError
from tierckpt.integrations._tree import TREE_KEY, join, load_tree, save_tree, split


def _checkpoint() -> dict:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return {
        "global_step": 7, "name": "run", "flags": (True, None, 2.5),
        "state_dict": collections.OrderedDict(model.state_dict()),
        "optimizer_states": [optimizer.state_dict()],  # integer-keyed "state": DCP would make it a list
        "ints": torch.arange(5, dtype=torch.int64), "half": torch.randn(3, dtype=torch.bfloat16),
        "nested": {"a": [torch.ones(2), {"b": torch.zeros(1, 1)}]},
    }


def _same(a: object, b: object) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def test_split_join_round_trip_keeps_types_and_keys() -> None:
    obj = _checkpoint()
    skeleton, tensors = split(obj)
    assert "state_dict.weight" in tensors and "optimizer_states.0.state.0.exp_avg" in tensors
    _same(join(skeleton, tensors), obj)
    clash = {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}  # two paths with one dotted name
    skeleton, tensors = split(clash)
    assert len(tensors) == 2
    _same(join(skeleton, tensors), clash)


def test_save_load_tree_bitwise_and_plain_dcp_readable(shm_root: Path, durable_dir: Path) -> None:
    cfg = CheckpointConfig(namespace="tree", memory_dir=str(shm_root), durable_url=f"file://{durable_dir}")
    with pytest.raises(CheckpointNotFoundError):
        load_tree(cfg)
    obj = _checkpoint()
    save_tree(cfg, 7, obj, durable=True)
    step, back = load_tree(cfg)
    assert step == 7
    _same(back, obj)
    restored = torch.optim.Adam(torch.nn.Linear(4, 3).parameters())
    restored.load_state_dict(back["optimizer_states"][0])  # integer keys survived
    plain = {TREE_KEY: None, "ints": torch.empty(5, dtype=torch.int64)}  # without tierckpt
    dcp.load(plain, storage_reader=dcp.FileSystemReader(str(durable_dir / "tree" / "step_7")), no_dist=True)
    assert torch.equal(plain["ints"], obj["ints"])


@pytest.mark.parametrize("state", [{"w": torch.ones(3)}, {TREE_KEY: torch.ones(1)}], ids=["no-tree", "tensor-tree"])
def test_load_tree_refuses_a_step_not_saved_as_a_tree(shm_root: Path, state: dict) -> None:
    cfg = CheckpointConfig(namespace="plain", memory_dir=str(shm_root))
    with Checkpointer(cfg) as ck:
        ck.save(1, state)
    with pytest.raises(StateDictMismatchError, match="not saved by save_tree"):
        load_tree(cfg)
