"""The heartbeat record names the first non-finite step, however many steps the worker runs
before the launcher reads it (CI's slow tier: a NaN at step 8, the agent's poll came after the
worker's step 9, and every later generation resumed below 9, not 8)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import tierckpt.monitor as monitor
from tierckpt.launcher.detect.heartbeat import BeatTracker, HeartbeatPolicy
from tierckpt.monitor import NON_FINITE_LOSS, read_beat


@pytest.fixture
def beat_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TIERCKPT_MONITOR_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(monitor, "_writer_pid", None)  # a fresh writer for this test's directory
    monkeypatch.setattr(monitor, "_non_finite_since", None)
    return tmp_path / "beat_0"


def test_steps_after_a_nan_keep_the_record_at_the_first_non_finite_step(beat_file: Path) -> None:
    monitor.step(7, loss=0.25)
    monitor.step(8, loss=math.nan)
    monitor.step(9, loss=math.nan)
    monitor.step(10, loss=0.5)  # a finite loss later does not clear the fault either
    beat = read_beat(str(beat_file))
    assert beat is not None and beat.non_finite and beat.step == 8 and beat.seq == 4, beat
    tr = BeatTracker(HeartbeatPolicy(), start=0.0)
    assert tr.observe(beat, 1.0)
    reason, detail = tr.check(1.0) or ("", "")
    assert reason == NON_FINITE_LOSS and detail.startswith("step 8:"), detail


def test_a_beat_after_a_nan_keeps_the_step_too(beat_file: Path) -> None:
    monitor.step(3, loss=math.inf)
    monitor.beat()
    monitor.step(4, loss=math.inf)
    beat = read_beat(str(beat_file))
    assert beat is not None and beat.non_finite and beat.step == 3, beat
