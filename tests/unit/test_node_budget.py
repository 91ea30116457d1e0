"""The node budget (issue 19, item 5): one cap on everything the node's memory root holds.

Real shared memory: the budget counts every file under the memory root (each inode once),
the node's own older steps are evicted to make room (those with a durable copy first; never
the newest committed step, never a pinned one) and a save that still does not fit fails
with ``MemoryBudgetError`` while the previous step stays loadable, bitwise.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tierckpt import CheckpointConfig, Checkpointer, ConfigError, MemoryBudgetError
from tierckpt.config import parse_memory_budget
from tierckpt.node.budget import node_usage_bytes
from tierckpt.policy import RetentionPolicy
from tierckpt.tiers.local import LocalTier

MIB = 2**20


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 1024, generator=g)}  # 1 MiB


def slot_bytes(root: Path, ns: str, step: int) -> int:
    return (root / ns / f"step_{step}" / "__0_0.distcp").stat().st_size


def memory_steps(ck: Checkpointer) -> list[int]:
    return sorted(s.step for s in ck.steps() if "memory" in s.tiers)


def test_parse_memory_budget() -> None:
    assert parse_memory_budget("40%", 1000) == 400
    assert parse_memory_budget("64G", 0) == 64 * 2**30
    assert parse_memory_budget("512M", 0) == 512 * MIB
    assert parse_memory_budget(12345, 0) == 12345
    for bad in ("10%", "101%", "lots", 0, True):
        with pytest.raises(ConfigError, match="node_memory_budget"):
            CheckpointConfig(namespace="x", node_memory_budget=bad)


def test_eviction_order_prefers_copied_steps_and_spares_newest_and_busy() -> None:
    order = RetentionPolicy.select_for_eviction([1, 2, 3, 4, 5], copied={3, 5}, busy={2})
    assert order == [3, 1, 4]  # 5 is the newest; 2 is pinned; 3 has a copy elsewhere


def test_own_steps_are_evicted_oldest_copied_first(shm_root: Path, durable_dir: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    base = CheckpointConfig(namespace="nb", memory_dir=str(shm_root), durable_url=f"file://{durable_dir}",
                            durable_every_n_steps=0, memory_steps_retained=10)
    with Checkpointer(base) as probe:  # one slot's size, on the real tmpfs
        probe.save(0, state(0)).result()
        nbytes = slot_bytes(shm_root, "nb", 0)
    budget = node_usage_bytes(shm_root) + 3 * nbytes + nbytes // 2  # probe's step 0 stays: room for ~3 more
    cfg = base.replace(namespace="nb2", node_memory_budget=budget)
    with Checkpointer(cfg) as ck, caplog.at_level(logging.WARNING, logger="tierckpt"):
        ck.save(1, state(1)).result()
        ck.save(2, state(2), durable=True).result()
        ck.save(3, state(3)).result()
        assert node_usage_bytes(shm_root) <= budget
        ck.save(4, state(4)).result()  # no room: step 2 (durable) goes before the older step 1
        assert memory_steps(ck) == [1, 3, 4]
        assert node_usage_bytes(shm_root) <= budget
        assert "evicted from memory to make room" in caplog.text
        pin = LocalTier(shm_root, "nb2", name="memory", durable=False).pin(1, "__0_0.distcp")
        assert pin is not None
        try:  # step 1 is in use: step 3 goes instead, though older steps come first otherwise
            ck.save(5, state(5)).result()
            assert memory_steps(ck) == [1, 4, 5]
        finally:
            LocalTier.unpin(pin)
        ck.save(6, state(6)).result()
        assert memory_steps(ck) == [4, 5, 6] and node_usage_bytes(shm_root) <= budget
        for step in (2, 6):  # the evicted durable step loads from the durable tier, the newest from memory
            out = {"w": torch.zeros(256, 1024)}
            assert ck.load(out, step=step) == step
            assert torch.equal(out["w"], state(step)["w"])


def test_a_save_that_does_not_fit_fails_typed_and_keeps_the_previous_step(shm_root: Path) -> None:
    cfg = CheckpointConfig(namespace="nbf", memory_dir=str(shm_root), durable_url=None, memory_steps_retained=2)
    with Checkpointer(cfg) as probe:
        probe.save(0, state(0)).result()
        nbytes = slot_bytes(shm_root, "nbf", 0)
    # what else the node holds counts too: a replica of another node and a peer-cache copy
    for where in (".replicas/node-b/nbf/step_7", ".peer/nbf/step_7"):
        (shm_root / where).mkdir(parents=True)
        (shm_root / where / "__1_0.distcp").write_bytes(b"\1" * nbytes)
    budget = node_usage_bytes(shm_root) + nbytes // 2  # the replicas leave no room for a second slot
    with Checkpointer(cfg.replace(namespace="nbf2", node_memory_budget=budget)) as ck:
        with pytest.raises(MemoryBudgetError, match="node's memory root already holds") as info:
            ck.save(1, state(1))
        assert info.value.tier == "memory" and "node_memory_budget" in str(info.value)
    with Checkpointer(cfg.replace(node_memory_budget=budget)) as ck:
        with pytest.raises(MemoryBudgetError):
            ck.save(1, state(1))  # the newest committed step (0) is never evicted to make room
        out = {"w": torch.zeros(256, 1024)}
        assert ck.load(out) == 0 and torch.equal(out["w"], state(0)["w"])


def test_node_budget_from_the_environment() -> None:
    from tierckpt.config import node_ram_bytes

    cfg = CheckpointConfig.from_env({"TIERCKPT_NAMESPACE": "env", "TIERCKPT_NODE_MEMORY_BUDGET": "40%"})
    assert cfg.node_memory_budget == "40%" and cfg.node_budget_bytes == int(node_ram_bytes() * 0.4)
    assert CheckpointConfig(namespace="n").node_budget_bytes is None
