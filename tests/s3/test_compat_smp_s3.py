"""SMP's ``s3://`` checkpoint_id (seed 003: "save checkpoints directly to Amazon S3"): async_save
and load with ``checkpoint_id=f"s3://{bucket}/{key}"`` against the session's SeaweedFS."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch

from tierckpt.compat.smp import async_save, load, maybe_finalize_async_calls


@pytest.mark.s3
def test_an_s3_checkpoint_id_saves_and_loads_bitwise_after_the_node_is_gone(
    s3_env: dict[str, str], s3_client: Any, bucket: str, memory_dir: str
) -> None:
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(64, 32), "b": torch.arange(7)}, "optimizer": {"step": torch.tensor(5.0)}}
    key = "checkpoints/llama-400steps/tp0_ep0_fsdp0"
    checkpoint_id = f"s3://{bucket}/{key}"
    async_save(state, checkpoint_id=checkpoint_id, memory_dir=memory_dir)
    maybe_finalize_async_calls(blocking=True)
    keys = sorted(o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix=key + "/").get("Contents", []))
    assert f"{key}/step_0/COMMITTED" in keys and f"{key}/step_0/.metadata" in keys
    shutil.rmtree(memory_dir + "-smp")  # a new node: only S3 holds it
    got: dict[str, Any] = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(7, dtype=torch.int64)},
                           "optimizer": {"step": torch.tensor(0.0)}}
    load(got, checkpoint_id=checkpoint_id, memory_dir=memory_dir)
    assert torch.equal(got["model"]["w"], state["model"]["w"]) and torch.equal(got["model"]["b"], state["model"]["b"])
    assert torch.equal(got["optimizer"]["step"], torch.tensor(5.0))
