"""Memory retention and budget eviction spare the steps the node agent protects (``.keep``)."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import torch

import tierckpt
from tierckpt.node.keep import KEEP_FILE, read_protected, write_protected
from tierckpt.policy import RetentionPolicy

NS = "keep-run"


def test_policy_spares_protected_steps_and_keeps_the_newest_others() -> None:
    assert RetentionPolicy(2).select_for_deletion([1, 2, 3, 4, 5], {2}) == [1, 3]
    assert RetentionPolicy(2).select_for_deletion([1, 2, 3, 4, 5], {5}) == [1, 2]
    assert RetentionPolicy(1).select_for_deletion([1, 2, 3], {1, 2}) == []
    assert RetentionPolicy.select_for_eviction([1, 2, 3, 4], protected={2}) == [1, 3, 2]  # protected: last
    assert RetentionPolicy.select_for_eviction([1, 2, 3, 4], protected={4}) == [1, 2, 3]  # never the newest anyway


def _write(ns_dir: Path, steps: list[int]) -> None:
    fd = os.open(ns_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        write_protected(fd, steps)
    finally:
        os.close(fd)


def test_keep_file_round_trip_private_and_garbage_protects_nothing(tmp_path: Path) -> None:
    assert read_protected(tmp_path) == frozenset()
    _write(tmp_path, [7, 3, 7])
    assert read_protected(tmp_path) == {3, 7}
    assert stat.S_IMODE((tmp_path / KEEP_FILE).stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [KEEP_FILE]  # no temporary file left
    for raw in (b"not json", b'{"a": 1}', b'[1, "2", true, -3]'):
        (tmp_path / KEEP_FILE).write_bytes(raw)
        assert read_protected(tmp_path) in (frozenset(), {1})


def test_saves_spare_a_protected_step_in_memory(tmp_path: Path) -> None:
    """A real Checkpointer (shared-memory tier, retention 2): step 2 listed in .keep outlives
    retention; once no longer listed, the next save's retention deletes it."""
    root = Path("/dev/shm") / f"tierckpt-keep-{os.getpid()}"
    cfg = tierckpt.CheckpointConfig(namespace=NS, memory_dir=str(root), memory_steps_retained=2)
    try:
        with tierckpt.Checkpointer(cfg) as ck:
            for step in (1, 2):
                ck.save(step, {"w": torch.full((64,), float(step))})
                ck.wait()
            _write(root / NS, [2])
            for step in (3, 4, 5):
                ck.save(step, {"w": torch.full((64,), float(step))})
                ck.wait()
            assert sorted(int(p.name[5:]) for p in (root / NS).glob("step_*")) == [2, 4, 5]
            _write(root / NS, [])
            ck.save(6, {"w": torch.full((64,), 6.0)})
            ck.wait()
            assert sorted(int(p.name[5:]) for p in (root / NS).glob("step_*")) == [5, 6]
    finally:
        shutil.rmtree(root, ignore_errors=True)
