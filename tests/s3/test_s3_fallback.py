"""A full memory tier falls back to S3 (issue 19, item 6): the step is written to the bucket
directly, warned about, and loads back from S3 bitwise; the step before stays in memory."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.s3


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1536, 1024, generator=g)}  # 6 MiB: two parts of 5 MiB on S3


def test_full_memory_tier_falls_back_to_s3(small_tmpfs: Any, s3_env: dict[str, str], bucket: str,
                                           caplog: pytest.LogCaptureFixture) -> None:
    from tierckpt import CheckpointConfig, Checkpointer, S3Settings

    mem = small_tmpfs("8m")
    cfg = CheckpointConfig(namespace="fbs3", memory_dir=str(mem), durable_url=f"s3://{bucket}/ckpt",
                           durable_every_n_steps=0, s3=S3Settings(part_size=5 * 2**20, max_attempts=3))
    with Checkpointer(cfg) as ck:
        ck.save(1, _state(1)).result()  # fits the 8 MiB tmpfs
        handle = ck.save(2, _state(2))  # step 1 keeps its slot: no room for a second 6 MiB one
        handle.result()
        assert handle.fallback == "no_space"
        assert "the memory tier failed (no_space" in caplog.text
        assert {s.step: set(s.tiers) for s in ck.steps()} == {1: {"memory"}, 2: {"durable"}}
    with Checkpointer(cfg) as ck:
        for step, tier in ((2, "durable"), (1, "memory")):
            out = {"w": torch.zeros(1536, 1024)}
            assert ck.load(out, step=step) == step and ck.last_load["tiers"] == [tier]
            assert torch.equal(out["w"], _state(step)["w"])


def test_compat_writer_falls_back_to_s3_as_the_reference_does(small_tmpfs: Any, s3_env: dict[str, str],
                                                              bucket: str) -> None:
    import torch.distributed.checkpoint as dcp

    from tierckpt.compat.sagemaker import (
        SageMakerCheckpointConfig,
        SageMakerTieredStorageReader,
        SageMakerTieredStorageWriter,
    )

    mem = small_tmpfs("4m")
    config = SageMakerCheckpointConfig(namespace="job-fb", world_size=1, s3_tier_base_path=f"s3://{bucket}/base",
                                       save_to_s3=True, memory_dir=str(mem))
    sd = _state(9)  # 6 MiB: does not fit the 4 MiB memory tier
    dcp.save(sd, storage_writer=SageMakerTieredStorageWriter(config, step=9))
    out = {"w": torch.zeros(1536, 1024)}
    dcp.load(out, storage_reader=SageMakerTieredStorageReader(config, step=9))
    assert torch.equal(out["w"], sd["w"])
