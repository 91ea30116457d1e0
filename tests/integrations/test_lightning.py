"""Lightning's Trainer saving into the tiers through TierckptCheckpointIO, killed and resumed.

Each run is the real example script (examples/lightning_train.py) in its own process: a tiny
model, 2 optimizer steps per epoch, a checkpoint per epoch. The killed process dies by a real
SIGKILL right after step 4's checkpoint; the rerun resumes from the tiers, and its final state
must equal, bit for bit, that of a run that was never interrupted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("pytorch_lightning")

from tierckpt import CheckpointConfig  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_train.py"


def _train(memory_dir: Path, durable: Path, out: Path | None, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(EXAMPLE), "--namespace", "lit", "--memory-dir", str(memory_dir),
            "--durable-url", f"file://{durable}", *(extra if "--epochs" in extra else ("--epochs", "4", *extra))]
    if out is not None:
        argv += ["--out", str(out)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=180)


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for pid in sa:
        for name in sa[pid]:
            assert torch.equal(sa[pid][name], sb[pid][name]), (pid, name)


@pytest.mark.slow
def test_killed_trainer_resumes_bitwise_and_async_saves_match(shm_root: Path, tmp_path: Path) -> None:
    from tierckpt.integrations.lightning import LATEST, TierckptCheckpointIO

    # a run never interrupted, saving through Lightning's AsyncCheckpointIO
    ref_mem, ref_dur = shm_root / "ref", tmp_path / "ref"
    done = _train(ref_mem, ref_dur, tmp_path / "ref.pt", "--async-save")
    assert done.returncode == 0, done.stderr[-3000:]
    reference = torch.load(tmp_path / "ref.pt", weights_only=False)
    assert reference["saved_steps"] == [2, 4, 6, 8] and reference["resumed_from"] is None

    # the async saves hold the values of their step: the last one equals the final state
    io = TierckptCheckpointIO(CheckpointConfig(namespace="lit", memory_dir=str(ref_mem)))
    last = io.load_checkpoint(LATEST)
    assert io.loaded_step == 8 and last["global_step"] == 8 and last["epoch"] == 3
    for key, value in reference["model"].items():
        assert torch.equal(last["state_dict"][key], value), key

    # killed by SIGKILL at step 4 (synchronous saves), then resumed from the tiers
    mem, dur = shm_root / "run", tmp_path / "run"
    killed = _train(mem, dur, None, "--kill-at-step", "4")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p for p in os.listdir(dur / "lit") if p.startswith("step_")) == ["step_2", "step_4"]
    resumed = _train(mem, dur, tmp_path / "resumed.pt")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    state = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert state["resumed_from"] == 4 and state["saved_steps"] == [6, 8] and state["global_step"] == 8
    _assert_same_state(state, reference)


def test_step_names_and_fresh_start(shm_root: Path, tmp_path: Path) -> None:
    from tierckpt.errors import CheckpointNotFoundError, ConfigError
    from tierckpt.integrations.lightning import LATEST, TierckptCheckpointIO

    io = TierckptCheckpointIO(CheckpointConfig(namespace="names", memory_dir=str(shm_root)))
    assert io.resume_path() is None
    assert io.step_for("/x/epoch=1-step=40.ckpt") == 40 and io.step_for("run/step_7") == 7
    assert io.step_for(LATEST) is None and io.step_for("/x/last.ckpt") is None  # "last": the newest step
    with pytest.raises(ConfigError, match="names no step.*'last'"):
        io.step_for("/x/model.ckpt")
    with pytest.raises(CheckpointNotFoundError):
        io.load_checkpoint(LATEST)
    weights = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    last = str(tmp_path / "last.ckpt")
    io.save_checkpoint({"global_step": 3, "epoch": 0, "state_dict": weights, "optimizer_states": []}, last)
    assert io.resume_path() == LATEST and io.step_for(tmp_path / "epoch=0-step=3.ckpt") == 3
    back = io.load_checkpoint(last)
    assert torch.equal(back["state_dict"]["w"], weights["w"]) and back["optimizer_states"] == []


@pytest.mark.slow
def test_ddp_rank0_saves_and_both_ranks_resume_the_same_step(shm_root: Path, tmp_path: Path) -> None:
    """Lightning DDP on 2 CPU processes (gloo): only global rank 0 saves (no collective in the
    save); at resume both ranks load through one collective load and agree on step 2."""
    from tierckpt.integrations.lightning import TierckptCheckpointIO

    mem, dur = shm_root / "ddp", tmp_path / "ddp"
    first = _train(mem, dur, tmp_path / "first.pt", "--devices", "2", "--epochs", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "rank 0: resumed from step None; saved steps [1, 2]" in first.stdout
    assert "rank 1: resumed from step None; saved steps []" in first.stdout
    stopped = torch.load(tmp_path / "first.pt", weights_only=False)

    second = _train(mem, dur, tmp_path / "second.pt", "--devices", "2", "--epochs", "4")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "rank 0: resumed from step 2; saved steps [3, 4]; global step 4" in second.stdout
    assert "rank 1: resumed from step 2; saved steps []; global step 4" in second.stdout

    io = TierckptCheckpointIO(CheckpointConfig(namespace="lit", memory_dir=str(mem), durable_url=f"file://{dur}"))
    saved = io.load_checkpoint("epoch=1-step=2.ckpt")  # memory keeps steps 3 and 4: from the durable tier
    for key, value in stopped["model"].items():
        assert torch.equal(saved["state_dict"][key], value), key
