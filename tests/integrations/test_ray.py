"""Ray Train's ``Checkpoint`` over tierckpt's S3 tier, on the real SeaweedFS server.

tierckpt writes a step to S3 (its own multipart uploads, marker last); Ray's own code
(``Checkpoint.to_directory`` through a pyarrow S3 filesystem) downloads it and plain DCP loads
it; a fresh node (empty memory tier) resumes the step a Ray checkpoint names from S3.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

pytest.importorskip("ray.train")

from tierckpt import CheckpointConfig, Checkpointer, ConfigError  # noqa: E402
from tierckpt.integrations.ray import load_ray_checkpoint, step_of, to_ray_checkpoint  # noqa: E402


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
