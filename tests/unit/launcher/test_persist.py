"""Persist on the way out (``launcher/persist.py``): each node sends the files it holds, the
leader commits once the barrier says every node did; a memory copy that fails its checks is not sent."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.contract.copy_contract import FILES, NS, memory_tier, pins_held, save_step
from tierckpt.config import CheckpointConfig
from tierckpt.launcher.dataplane.persist import persist_all, persist_newest
from tierckpt.tiers import LocalTier
from tierckpt.tiers.integrity import verify_copy


def _config(memory: Path, durable: Path) -> CheckpointConfig:
    return CheckpointConfig(namespace=NS, memory_dir=str(memory), durable_url=f"file://{durable}")


def _durable(durable: Path, ns: str = NS) -> LocalTier:
    return LocalTier(durable, ns, name="durable", durable=True)


def test_one_node_persists_its_newest_step_once(tmp_path: Path, durable_dir: Path) -> None:
    save_step(memory_tier(tmp_path), 3)
    save_step(memory_tier(tmp_path), 4)
    config = _config(tmp_path, durable_dir)
    assert persist_newest(config, leader=True) == 4
    assert [s.step for s in _durable(durable_dir).list_steps()] == [4]
    assert verify_copy(_durable(durable_dir), 4, NS).ok
    assert persist_newest(config, leader=True) is None  # durable already
    assert pins_held(memory_tier(tmp_path)) == []


def test_each_node_sends_its_files_and_the_leader_commits_after_the_barrier(tmp_path: Path,
                                                                            durable_dir: Path) -> None:
    names = sorted(FILES)
    roots = [tmp_path / "node0", tmp_path / "node1"]
    for root, name in zip(roots, names, strict=True):
        save_step(memory_tier(root), 6, held=(name,))
    assert persist_newest(_config(roots[1], durable_dir), leader=False, barrier=lambda: True) == 6
    assert _durable(durable_dir).list_steps() == []  # a follower never commits
    assert persist_newest(_config(roots[0], durable_dir), leader=True, barrier=lambda: False) is None
    assert _durable(durable_dir).list_steps() == []  # the barrier failed: not every node sent its files
    assert persist_newest(_config(roots[0], durable_dir), leader=True, barrier=lambda: True) == 6
    assert verify_copy(_durable(durable_dir), 6, NS).ok


def test_a_corrupt_memory_copy_is_not_sent(tmp_path: Path, durable_dir: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    memory = memory_tier(tmp_path)
    save_step(memory, 2)
    path = memory.step_dir(2) / "__0_0.distcp"
    raw = bytearray(path.read_bytes())
    raw[7] ^= 0xFF
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="tierckpt.run"):
        assert persist_newest(_config(tmp_path, durable_dir), leader=True) is None
    assert "fails verification" in caplog.text and "not copied" in caplog.text
    assert _durable(durable_dir).list_steps(include_uncommitted=True) == []
    assert pins_held(memory_tier(tmp_path)) == []


def test_persist_all_takes_the_local_mode_namespaces_too(tmp_path: Path, durable_dir: Path) -> None:
    save_step(memory_tier(tmp_path), 1)
    rank1 = LocalTier(tmp_path, f"{NS}--rank1", name="memory", durable=False)
    save_step(rank1, 2)
    assert persist_all(_config(tmp_path, durable_dir), leader=False) == {NS: 1, f"{NS}--rank1": 2}
    assert verify_copy(_durable(durable_dir, f"{NS}--rank1"), 2, f"{NS}--rank1").ok
