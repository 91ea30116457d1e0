"""A save through the DCP plug-ins is progress for ``tierckpt run`` (issue 24, item 4): the writer
beats (``monitor.saved``), which meets ``startupDeadlineSeconds`` for a loop that never calls
``monitor.step``, without timing a rank that only saves as a hang."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierckpt.monitor as monitor
from tierckpt import CheckpointConfig, TieredStorageWriter
from tierckpt.launcher.detect.heartbeat import BeatTracker, HeartbeatPolicy
from tierckpt.monitor import Beat, read_beat


@pytest.fixture
def beat_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TIERCKPT_MONITOR_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(monitor, "_writer_pid", None)  # a fresh writer for this test's directory
    return tmp_path / "beat_0"


def test_a_dcp_save_writes_a_save_beat(beat_file: Path, shm_root: Path) -> None:
    assert read_beat(str(beat_file)) is None
    cfg = CheckpointConfig(namespace="beats", memory_dir=str(shm_root))
    dcp.save({"w": torch.arange(8.0)}, storage_writer=TieredStorageWriter(cfg, step=3))
    beat = read_beat(str(beat_file))
    assert beat is not None and beat.saved and beat.seq >= 1 and beat.step is None and not beat.non_finite
    tr = BeatTracker(HeartbeatPolicy(startup_deadline_s=30.0), start=0.0)
    assert tr.observe(beat, 1.0) and tr.first_beat
    assert tr.check(31.0) is None  # started by its save: no StartupDeadline
    monitor.step(4, loss=0.5)  # a step beat afterwards is an ordinary beat, without the flag
    after = read_beat(str(beat_file))
    assert after is not None and not after.saved and after.step == 4


def _saved(seq: int) -> Beat:
    return Beat(seq=seq, step=None, time=0.0, loss=None, non_finite=False, saved=True)


def _step(seq: int, step: int) -> Beat:
    return Beat(seq=seq, step=step, time=0.0, loss=1.0, non_finite=False)


def test_without_a_save_or_a_beat_the_startup_deadline_still_fails() -> None:
    tr = BeatTracker(HeartbeatPolicy(startup_deadline_s=30.0), start=0.0)
    assert not tr.first_beat
    assert (tr.check(31.0) or ("",))[0] == "StartupDeadline"


def test_a_rank_that_only_saves_is_never_timed() -> None:
    tr = BeatTracker(HeartbeatPolicy(startup_deadline_s=30.0), start=0.0)
    tr.observe(_saved(1), 5.0)
    tr.observe(_saved(2), 2000.0)
    assert tr.check(100_000.0) is None and not tr.wants_sample(100_000.0)
    assert tr.step is None and tr.first_step is None


def test_after_step_beats_a_save_resets_the_silence() -> None:
    tr = BeatTracker(HeartbeatPolicy(fixed_timeout_s=10.0), start=0.0)
    tr.observe(_step(1, 7), 1.0)
    assert tr.check(12.0) is not None  # 11 s silent: a hang under the fixed 10 s timeout
    tr.observe(_saved(2), 9.0)  # ... unless a save came in between
    assert tr.check(12.0) is None and tr.step == 7 and tr.first_step == 7
    assert not math.isnan(tr.longest)
