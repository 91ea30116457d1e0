"""The launcher's restart-state file on an ``s3://`` durable tier (issue 24, item 5), against the
session's SeaweedFS: written beside the namespace's steps, read back on a fresh machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tierckpt import layout
from tierckpt.launcher.options import RunOptions
from tierckpt.launcher.supervisor import runstate

STATE = {"next_generation": 5, "full_restarts": 1, "restarts": 4, "job_started": 1_700_000_000.25,
         "resume_before": None, "unhealthy_before": 2, "offenses": {}}


def test_the_state_file_goes_to_s3_and_comes_back_on_a_fresh_machine(tmp_path: Path, s3_client: Any,
                                                                      bucket: str) -> None:
    url = f"s3://{bucket}/ckpt"
    node, fresh = tmp_path / "node", tmp_path / "fresh"
    assert runstate.save(RunOptions(memory_dir=str(node), durable_url=url, namespace="run1"), "job", STATE) is None
    body = s3_client.get_object(Bucket=bucket, Key=f"ckpt/run1/{runstate.STATE_DIR}/job.json")["Body"].read()
    assert body == b'{"next_generation": 5, "full_restarts": 1, "restarts": 4, "job_started": 1700000000.25, ' \
                   b'"resume_before": null, "unhealthy_before": 2, "offenses": {}}'
    fresh.mkdir()
    assert runstate.load(RunOptions(memory_dir=str(fresh), durable_url=url, namespace="run1"), "job") == STATE
    # another job id, or another namespace: nothing
    assert runstate.load(RunOptions(memory_dir=str(fresh), durable_url=url, namespace="run1"), "other") == {}
    assert runstate.load(RunOptions(memory_dir=str(fresh), durable_url=url, namespace="run2"), "job") == {}
    # the state file is no step of the namespace
    from tierckpt.config import CheckpointConfig
    from tierckpt.tiers import open_durable

    tier = open_durable(CheckpointConfig(namespace="run1", memory_dir=str(fresh), durable_url=url))
    assert tier is not None and tier.list_steps(include_uncommitted=True) == []
    assert layout.parse_step_dir(runstate.STATE_DIR) is None


def test_an_unreachable_s3_is_reported_and_the_local_copy_holds(tmp_path: Path, s3_env: Any) -> None:
    url = "s3://no-such-bucket-tierckpt/ckpt"
    opts = RunOptions(memory_dir=str(tmp_path / "node"), durable_url=url, namespace="run1")
    problem = runstate.save(opts, "job", STATE)
    assert problem is not None and "no-such-bucket-tierckpt" in problem
    assert runstate.load(opts, "job") == STATE
    assert runstate.load(RunOptions(memory_dir=str(tmp_path / "fresh"), durable_url=url, namespace="run1"), "job") == {}
