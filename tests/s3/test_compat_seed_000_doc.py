"""Seed 000 (the set-up page) in its own names: the example in ``docs/compat.md`` runs as written,
and the deprecated ``save_state_dict`` / ``load_state_dict`` entry points work on this torch.

The doc's block is read from the file (the fenced block after ``<!-- example: seed-000 -->``) and
run unedited on 2 real gloo ranks against the session's SeaweedFS; the test only sets what a
job's environment sets (AWS variables, ``TIERCKPT_MEMORY_DIR`` as ``tierckpt run --memory-dir``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import checkpoint as dist_cp

from tierckpt.compat.sagemaker import (
    CheckpointConfig,
    SageMakerCheckpointConfig,
    SageMakerTieredStorageConfigError,
    SageMakerTieredStorageReader,
    SageMakerTieredStorageWriter,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "compat.md"


def doc_example(tag: str) -> str:
    text = DOC.read_text()
    found = re.search(rf"<!-- example: {re.escape(tag)} -->\n```python\n(.*?)\n```", text, re.S)
    assert found, f"docs/compat.md has no example tagged {tag!r}"
    return found.group(1)


def _run_doc_on_rank(rank: int, code: str, env: dict[str, str]) -> dict[str, Any]:
    os.environ.update(env)
    ns: dict[str, Any] = {"__name__": "__doc_example__"}
    exec(compile(code, str(DOC), "exec"), ns)
    torch.manual_seed(0)
    w0 = torch.nn.Linear(16, 4).weight.detach().clone()
    w150 = w0.clone().add_(1.0)
    w200 = w150.clone().add_(1.0)
    return {
        "step150": ns["state_dict"]["step"], "w150": torch.equal(ns["state_dict"]["model"]["weight"], w150),
        "newest": ns["newest"]["step"], "w200": torch.equal(ns["newest"]["model"]["weight"], w200),
        "reader_step": ns["smReader"].step, "s3_at": [ns["checkpoint_config"].saves_to_s3(s) for s in (100, 150, 200)],
    }


@pytest.mark.s3
def test_the_seed_000_example_in_the_docs_runs_unedited_on_two_ranks(
    s3_env: dict[str, str], s3_client: Any, shm_factory: Any
) -> None:
    from tests.helpers.dist import run_ranks

    code = doc_example("seed-000")
    assert "sm_ckpt.CheckpointConfig(" in code and "in_memory_namespace=" in code and "s3_every_n_steps=100" in code
    bucket, prefix = "bucket-name", "checkpointing-path-prefix/"
    if bucket not in [b["Name"] for b in s3_client.list_buckets().get("Buckets", [])]:
        s3_client.create_bucket(Bucket=bucket)
    _empty(s3_client, bucket, prefix)
    env = dict(s3_env, TIERCKPT_MEMORY_DIR=shm_factory("seed000"))
    try:
        results = run_ranks(_run_doc_on_rank, 2, code, env, timeout=180)
        keys = sorted(o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))
    finally:
        _empty(s3_client, bucket, prefix)
    for got in results:
        assert got == {"step150": 150, "w150": True, "newest": 200, "w200": True, "reader_step": 150,
                       "s3_at": [True, False, True]}
    # s3_every_n_steps=100: steps 100 and 200 went to S3 in the seed's layout, step 150 did not
    steps = {int(m.group(1)) for k in keys if (m := re.search(r"/step_(\d+)/", k))}
    assert steps == {100, 200}
    for step in (100, 200):
        assert f"{prefix}my-ml-workload/rank_0/step_{step}/metadata.metadata" in keys
        assert f"{prefix}my-ml-workload/rank_0/step_{step}/checkpoint.pt" in keys


def _empty(client: Any, bucket: str, prefix: str) -> None:
    for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []):
        client.delete_object(Bucket=bucket, Key=o["Key"])


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(8, 3, generator=g), "b": torch.arange(step, step + 5)}, "step": step}


def _blank() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(8, 3), "b": torch.zeros(5, dtype=torch.int64)}, "step": -1}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step"] == b["step"] and all(torch.equal(a["model"][k], b["model"][k]) for k in ("w", "b"))


def test_the_deprecated_entry_points_save_and_load_through_the_drop_in(memory_dir: str) -> None:
    config = CheckpointConfig(world_size=1, in_memory_namespace="dep-entry", memory_dir=memory_dir)
    for step in (3, 4):
        writer = SageMakerTieredStorageWriter(config, step=step)
        with pytest.warns(FutureWarning, match="save_state_dict` is deprecated"):
            dist_cp.save_state_dict(state_dict=_state(step), storage_writer=writer, no_dist=True)
    got = _blank()
    with pytest.warns(FutureWarning, match="load_state_dict` is deprecated"):
        dist_cp.load_state_dict(state_dict=got, storage_reader=SageMakerTieredStorageReader(config=config), no_dist=True)
    assert _same(got, _state(4))  # newest
    got = _blank()
    with pytest.warns(FutureWarning, match="load_state_dict` is deprecated"):
        dist_cp.load_state_dict(got, SageMakerTieredStorageReader(config, step=3), no_dist=True)
    assert _same(got, _state(3))
    # the page's own calls pass checkpoint_id, which these functions never took (hence docs/compat.md)
    with pytest.warns(FutureWarning), pytest.raises(TypeError, match="checkpoint_id"):
        dist_cp.save_state_dict(state_dict=_state(5), checkpoint_id="step_5",  # type: ignore[call-arg]
                                storage_writer=SageMakerTieredStorageWriter(config))
    with pytest.warns(FutureWarning), pytest.raises(TypeError, match="checkpoint_id"):
        dist_cp.load_state_dict(state_dict=_blank(), checkpoint_id="step_3",  # type: ignore[call-arg]
                                storage_reader=SageMakerTieredStorageReader(config=config))


def test_seed_000_spellings_map_to_the_seeds_fields() -> None:
    config = CheckpointConfig(world_size=100, in_memory_namespace="my-ml-workload",
                              s3_base_path="s3://bucket-name/checkpointing-path-prefix/", s3_every_n_steps=100)
    assert isinstance(config, SageMakerCheckpointConfig)
    assert (config.namespace, config.s3_tier_base_path, config.world_size) == (
        "my-ml-workload", "s3://bucket-name/checkpointing-path-prefix/", 100)
    assert [config.saves_to_s3(s) for s in (0, 100, 150, 300)] == [True, True, False, True]
    config.in_memory_namespace = "renamed"
    assert config.namespace == "renamed"
    same = CheckpointConfig(world_size=2, namespace="a", s3_tier_base_path="s3://b/p")
    assert (same.in_memory_namespace, same.s3_base_path) == ("a", "s3://b/p")
    with pytest.raises(SageMakerTieredStorageConfigError, match="pass in_memory_namespace= or namespace=, not both"):
        CheckpointConfig(world_size=1, in_memory_namespace="a", namespace="a")
    with pytest.raises(SageMakerTieredStorageConfigError, match="s3_every_n_steps must be a whole number >= 0"):
        CheckpointConfig(world_size=1, in_memory_namespace="a", s3_base_path="s3://b/p", s3_every_n_steps=-1)
    with pytest.raises(SageMakerTieredStorageConfigError, match="s3_every_n_steps=10 but no S3 path configured"):
        SageMakerTieredStorageWriter(CheckpointConfig(world_size=1, in_memory_namespace="a", s3_every_n_steps=10), step=1)
    with pytest.raises(TypeError):
        CheckpointConfig(1, "a")  # type: ignore[misc]  # keyword-only, as the page writes it


def test_s3_every_n_steps_decides_per_writer_step_also_from_checkpoint_id(memory_dir: str) -> None:
    config = CheckpointConfig(world_size=1, in_memory_namespace="every", s3_base_path="s3://bucket-name/p",
                              s3_every_n_steps=50, memory_dir=memory_dir)
    assert [SageMakerTieredStorageWriter(config, step=s).save_to_s3 for s in (50, 51, 100)] == [True, False, True]
    tierckpt_layout = CheckpointConfig(world_size=1, in_memory_namespace="every", s3_base_path="s3://bucket-name/p",
                                       s3_every_n_steps=50, memory_dir=memory_dir, s3_layout="tierckpt")
    writer = SageMakerTieredStorageWriter(tierckpt_layout, step=100)
    assert writer.save_to_s3 and writer.durable  # tierckpt's layout: the durable tier takes it
    basic = SageMakerTieredStorageWriter(config)  # no step yet: decided when checkpoint_id names it
    assert basic.save_to_s3 is False
    basic.reset("ckpt/step_150")
    assert (basic.step, basic.save_to_s3) == (150, True)
    basic = SageMakerTieredStorageWriter(config)
    basic.reset("step_151")
    assert (basic.step, basic.save_to_s3) == (151, False)
