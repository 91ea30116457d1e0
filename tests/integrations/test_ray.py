"""Ray Train's ``Checkpoint`` over tierckpt's S3 tier, on the real SeaweedFS server.

tierckpt writes a step to S3 (its own multipart uploads, marker last); Ray's own code
(``Checkpoint.to_directory`` through a pyarrow S3 filesystem) downloads it and plain DCP loads
it; a fresh node (empty memory tier) resumes the step a Ray checkpoint names from S3.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

pytest.importorskip("ray.train")

from tierckpt import CheckpointConfig, Checkpointer, ConfigError  # noqa: E402
from tierckpt.integrations.ray import load_ray_checkpoint, step_of, to_ray_checkpoint  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(64, generator=g)},
            "optim": {"exp_avg": torch.randn(64, 32, generator=g)}}


def _blank() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(64)}, "optim": {"exp_avg": torch.zeros(64, 32)}}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    for part in ("model", "optim"):
        for key in a[part]:
            assert torch.equal(a[part][key], b[part][key]), (part, key)


@pytest.mark.s3
def test_ray_checkpoint_round_trip_through_s3(s3_env: dict[str, str], bucket: str, memory_dir: str) -> None:
    cfg = CheckpointConfig(namespace="ray-run", memory_dir=memory_dir, durable_url=f"s3://{bucket}/exp/run1",
                           durable_every_n_steps=2)
    with Checkpointer(cfg) as ck:
        for step in range(5):
            ck.save(step, _state(step))  # durable: 0, 2, 4
    checkpoint = to_ray_checkpoint(cfg, 4)
    assert checkpoint.path == f"{bucket}/exp/run1/ray-run/step_4" and step_of(checkpoint) == 4

    # Ray downloads the step with its own filesystem code; it is a plain DCP checkpoint
    local = Path(tempfile.mkdtemp(prefix="tierckpt-ray-"))
    try:
        checkpoint.to_directory(str(local))
        assert {"COMMITTED", "manifest.json", ".metadata"} <= {p.name for p in local.iterdir()}
        plain = _blank()
        dcp.load(plain, storage_reader=dcp.FileSystemReader(str(local)), no_dist=True)
        _equal(plain, _state(4))
    finally:
        shutil.rmtree(local, ignore_errors=True)

    # a fresh node resumes the step the Ray checkpoint names: S3 only, since its memory is empty
    fresh = Path(tempfile.mkdtemp(prefix="tierckpt-ray-fresh-", dir="/dev/shm"))
    try:
        cfg2 = CheckpointConfig(namespace="ray-run", memory_dir=str(fresh), durable_url=cfg.durable_url)
        with Checkpointer(cfg2) as ck:
            got = _blank()
            assert load_ray_checkpoint(ck, to_ray_checkpoint(cfg, 2), got) == 2
            assert ck.last_load["tiers"] == ["durable"]
            _equal(got, _state(2))
            assert load_ray_checkpoint(ck, None, _blank()) is None
    finally:
        shutil.rmtree(fresh, ignore_errors=True)


def test_step_of_names_the_step_or_says_what_is_wrong() -> None:
    from ray.train import Checkpoint

    assert step_of(Checkpoint(path="/exp/run/tierckpt/step_12")) == 12
    with pytest.raises(ConfigError, match="not a tierckpt step"):
        step_of(Checkpoint(path="/exp/run/checkpoint_2026-11-24_14-00-00.000000"))
    with pytest.raises(ConfigError, match="durable tier"):
        to_ray_checkpoint(CheckpointConfig(namespace="x", memory_dir="/dev/shm/unused"), 1)


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.skipif(os.environ.get("TIERCKPT_RAY_TRAINER_TEST") != "1",
                    reason="starts a local Ray instance (~80 s here); set TIERCKPT_RAY_TRAINER_TEST=1")
def test_torchtrainer_worker_failure_resumes_from_the_s3_tier(
    s3_env: dict[str, str], bucket: str, memory_dir: str
) -> None:
    """A real TorchTrainer (1 worker) on a local Ray instance, run storage on SeaweedFS.

    The training function raises once after step 3; Ray restarts the worker group, which resumes
    from the checkpoint tierckpt reported at step 2. The final step, loaded back from S3 by a
    fresh node, equals bit for bit a local run that never failed.
    """
    argv = [sys.executable, str(EXAMPLES / "ray_train.py"), "--storage-path", f"s3://{bucket}/results",
            "--memory-dir", memory_dir, "--steps", "6", "--report-every", "2", "--fail-at", "3"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=400, env=dict(os.environ, **s3_env))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(step 5)" in done.stdout and "'resumed_from': 2" in done.stdout, done.stdout

    sys.path.insert(0, str(EXAMPLES))
    try:
        import ray_train
    finally:
        sys.path.remove(str(EXAMPLES))
    model, optimizer = ray_train.make_model()
    for step in range(6):
        ray_train.train_step(model, optimizer, step)

    fresh = Path(tempfile.mkdtemp(prefix="tierckpt-ray-e2e-", dir="/dev/shm"))
    try:
        run_dir = f"s3://{bucket}/results/tierckpt-ray"
        cfg = CheckpointConfig(namespace="tierckpt", memory_dir=str(fresh), durable_url=run_dir)
        other_model, other_optimizer = ray_train.make_model()
        model_sd, optim_sd = get_state_dict(other_model, other_optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        with Checkpointer(cfg) as ck:
            assert load_ray_checkpoint(ck, to_ray_checkpoint(cfg, 5), state) == 5
        want_model, want_optim = get_state_dict(model, optimizer)
        for key, value in want_model.items():
            assert torch.equal(state["model"][key], value), key
        for fqn, entry in want_optim["state"].items():
            assert torch.equal(state["optim"]["state"][fqn]["momentum_buffer"], entry["momentum_buffer"]), fqn
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
