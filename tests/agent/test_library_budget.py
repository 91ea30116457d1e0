"""The library keeps the agent's node budget (issue 19, item 5): a save that needs room asks the
agent (``make_room``: replicas and the peer cache go) before it evicts any of the node's own steps."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from tierckpt import CheckpointConfig, Checkpointer
from tierckpt.node.budget import node_usage_bytes

MIB = 2**20


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 1024, generator=g)}  # 1 MiB


def test_saves_ask_the_agent_to_evict_replicas_before_own_steps(node_dir: Any, agent: Any) -> None:
    root = Path(node_dir("lib-budget"))
    donor = Path(node_dir("donor"))  # a committed step, placed as a replica from another node
    with Checkpointer(CheckpointConfig(namespace="job", memory_dir=str(donor), durable_url=None)) as ck:
        ck.save(3, {"r": torch.ones(512, 1024)}).result()  # 2 MiB
    replica = root / ".replicas" / "node-b" / "job" / "step_3"
    shutil.copytree(donor / "job" / "step_3", replica)
    budget = node_usage_bytes(root) + 3 * MIB + MIB // 2
    agent(memory_dir=str(root), node_id="node-a", replicas=0, budget_bytes=budget)
    cfg = CheckpointConfig(namespace="job", memory_dir=str(root), durable_url=None, memory_steps_retained=10)
    with Checkpointer(cfg) as ck:  # no node_memory_budget here: the agent's applies
        for step in range(4):
            ck.save(step, _state(step)).result()
            assert node_usage_bytes(root) <= budget
        assert not replica.exists()  # the agent evicted it for the library's save
        assert sorted(s.step for s in ck.steps()) == [0, 1, 2, 3]  # no own step had to go
        out = {"w": torch.zeros(256, 1024)}
        assert ck.load(out) == 3 and torch.equal(out["w"], _state(3)["w"])
