"""``tierckpt.compat.sagemaker``: the seed's README examples with only the import changed, and the
seed's validation messages, word for word."""

from __future__ import annotations

import logging
import shutil
import tempfile
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import async_save, load, save

from tierckpt import ConfigError, TierckptError
from tierckpt.compat.sagemaker import (
    SageMakerCheckpointConfig,
    SageMakerInMemoryTierError,
    SageMakerS3TierError,
    SageMakerTieredStorageConfigError,
    SageMakerTieredStorageError,
    SageMakerTieredStorageReader,
    SageMakerTieredStorageWriter,
    parse_step,
)


def model_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "model": {"layer.weight": torch.randn(256, 128, generator=g), "layer.bias": torch.randn(256, generator=g)},
        "optimizer": {"state": {"0": {"exp_avg": torch.randn(256, 128, generator=g)}}, "lr": 0.001},
        "step": step,
        "epoch": step // 10,
    }


def blank() -> dict[str, Any]:
    s = model_state(0)
    return {
        "model": {k: torch.zeros_like(v) for k, v in s["model"].items()},
        "optimizer": {"state": {"0": {"exp_avg": torch.zeros(256, 128)}}, "lr": 0.0},
        "step": 0,
        "epoch": 0,
    }


def assert_state(got: dict[str, Any], step: int) -> None:
    want = model_state(step)
    assert got["step"] == step and got["epoch"] == step // 10 and got["optimizer"]["lr"] == 0.001
    for k in want["model"]:
        assert torch.equal(got["model"][k], want["model"][k])
    assert torch.equal(got["optimizer"]["state"]["0"]["exp_avg"], want["optimizer"]["state"]["0"]["exp_avg"])


# -- the README, with the import changed -------------------------------------------------------
@pytest.mark.s3
def test_readme_training_loop_then_load_latest_and_a_specific_step(
    s3_env: dict[str, str], bucket: str, memory_dir: str
) -> None:
    checkpoint_config = SageMakerCheckpointConfig(
        namespace="job-readme", world_size=1, s3_tier_base_path=f"s3://{bucket}/checkpoints",
        memory_dir=memory_dir, logger=logging.getLogger("my.app"),
    )
    future = None
    in_memory_ckpt_freq, s3_ckpt_freq = 10, 20
    for training_step in range(0, 51, 5):
        if training_step % in_memory_ckpt_freq == 0 or training_step % s3_ckpt_freq == 0:
            state_dict = model_state(training_step)
            checkpoint_config.save_to_s3 = training_step % s3_ckpt_freq == 0
            storage_writer = SageMakerTieredStorageWriter(checkpoint_config=checkpoint_config, step=training_step)
            if future is not None:
                assert future.exception() is None
                future.result()
            future = async_save(state_dict=state_dict, storage_writer=storage_writer)
    assert future is not None
    future.result()

    state_dict = blank()
    load(state_dict, storage_reader=SageMakerTieredStorageReader(checkpoint_config=checkpoint_config))
    assert_state(state_dict, 50)  # the newest, from memory

    state_dict = blank()
    load(state_dict, storage_reader=SageMakerTieredStorageReader(checkpoint_config=checkpoint_config, step=30))
    assert_state(state_dict, 30)  # memory keeps 3 steps, like the seed's service

    # the node is replaced: memory is empty, S3 holds steps 0, 20 and 40
    shutil.rmtree(memory_dir)
    new_node = tempfile.mkdtemp(prefix="tierckpt-s3test-new-", dir="/dev/shm")
    try:
        checkpoint_config.memory_dir = new_node
        state_dict = blank()
        reader = SageMakerTieredStorageReader(checkpoint_config=checkpoint_config)
        load(state_dict, storage_reader=reader)
        assert_state(state_dict, 40)
        assert set(reader.tiers_used.values()) == {"durable"}
        with pytest.raises(BaseException, match="step 30 .* does not exist"):  # not in S3 nor new memory
            load(blank(), storage_reader=SageMakerTieredStorageReader(checkpoint_config=checkpoint_config, step=30))
    finally:
        shutil.rmtree(new_node, ignore_errors=True)


@pytest.mark.s3
def test_sync_save_with_a_path_and_s3_checkpoint_dir(s3_env: dict[str, str], bucket: str, memory_dir: str) -> None:
    config = SageMakerCheckpointConfig(namespace="job-sync", world_size=1, s3_tier_base_path=f"s3://{bucket}/base/",
                                       save_to_s3=True, memory_dir=memory_dir)
    writer = SageMakerTieredStorageWriter(config, path="/runs/step_7/ckpt")
    assert writer.step == 7 and writer.rank == 0
    assert writer.s3_checkpoint_dir == f"s3://{bucket}/base/job-sync/step_7"
    save(model_state(7), storage_writer=writer, checkpoint_id="ignored/step_99")
    state_dict = blank()
    load(state_dict, storage_reader=SageMakerTieredStorageReader(config, step=7))
    assert_state(state_dict, 7)


def test_memory_only_save_and_load_without_s3(memory_dir: str) -> None:
    config = SageMakerCheckpointConfig(namespace="job-mem", world_size=1, memory_dir=memory_dir)
    writer = SageMakerTieredStorageWriter(config, step=3)
    assert writer.s3_checkpoint_dir is None
    save(model_state(3), storage_writer=writer)
    state_dict = blank()
    load(state_dict, storage_reader=SageMakerTieredStorageReader(config))
    assert_state(state_dict, 3)


def test_nothing_to_load_is_an_error_not_a_silent_empty_load(memory_dir: str) -> None:
    config = SageMakerCheckpointConfig(namespace="job-none", world_size=1, memory_dir=memory_dir)
    with pytest.raises(BaseException, match="no checkpoint"):
        load(blank(), storage_reader=SageMakerTieredStorageReader(config))


# -- validation, with the seed's messages ------------------------------------------------------
def cfg(**kw: Any) -> SageMakerCheckpointConfig:
    return SageMakerCheckpointConfig(**{"namespace": "ns", "world_size": 2, **kw})


@pytest.mark.parametrize("make", [SageMakerTieredStorageWriter, SageMakerTieredStorageReader])
@pytest.mark.parametrize(
    "fields, message",
    [
        ({"namespace": ""}, "Namespace in SageMakerCheckpointConfig cannot be empty"),
        ({"world_size": 0}, "Invalid world size:0, expecting a positive integer"),
        ({"world_size": -3}, "Invalid world size:-3, expecting a positive integer"),
        ({"save_to_s3": True}, "S3 save enabled but no S3 path configured. Set s3_tier_base_path or s3_path_strategy."),
        ({"s3_tier_base_path": "gs://bucket/x"}, "Invalid S3 tier base path, should start with s3://"),
    ],
)
def test_seed_validation_messages(make: Any, fields: dict[str, Any], message: str) -> None:
    config = cfg(**fields)
    args = {"step": 1} if make is SageMakerTieredStorageWriter else {}
    with pytest.raises(SageMakerTieredStorageConfigError) as info:
        make(config, **args)
    assert str(info.value) == message


def test_both_base_path_and_strategy_is_a_value_error() -> None:
    class Strategy:
        base_path = "s3://b/p"

    with pytest.raises(ValueError, match="^Cannot specify both s3_tier_base_path and s3_path_strategy. Use one or the other.$"):
        cfg(s3_tier_base_path="s3://b/p", s3_path_strategy=Strategy())
    assert cfg(s3_path_strategy=Strategy()).get_s3_strategy().base_path == "s3://b/p"
    assert cfg(s3_tier_base_path="s3://b/q").get_s3_strategy().base_path == "s3://b/q"
    assert cfg().get_s3_strategy() is None


def test_non_int_world_size_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        SageMakerTieredStorageWriter(cfg(world_size="2"), step=1)


def test_empty_bucket_is_an_s3_tier_error() -> None:
    with pytest.raises(SageMakerS3TierError, match="^Invalid S3 path: bucket name is empty$"):
        SageMakerTieredStorageReader(cfg(s3_tier_base_path="s3:///prefix"))


def test_namespace_characters_are_checked_as_the_seed_promised() -> None:
    with pytest.raises(SageMakerTieredStorageConfigError, match="may contain only letters, digits"):
        SageMakerTieredStorageWriter(cfg(namespace="a/../b"), step=1)


@pytest.mark.parametrize(
    "path, step, expected",
    [
        ("", 5, 5), ("runs/step_42/ckpt", -1, 42), ("ckpt-step_3", -1, 3), ("/path/step_100/nested/step_200", -1, 100),
        ("my_step_dir/step_5", -1, 5),  # the seed rejected this one; tierckpt reads the last step_N
        ("s3://b/p/ns/step_8", 9, 9),
    ],
)
def test_step_from_argument_or_path(path: str, step: int, expected: int) -> None:
    assert parse_step(path, step) == expected


@pytest.mark.parametrize("path, step", [("", -1), ("step_7.pt", -1), ("no/step/here", -1), ("", -5)])
def test_invalid_step_has_the_seed_message(path: str, step: int) -> None:
    with pytest.raises(SageMakerTieredStorageError, match=r"^Invalid step value, step:-?\d+\. path:"):
        SageMakerTieredStorageWriter(cfg(), path=path, step=step)


def test_step_is_checked_before_the_config() -> None:
    with pytest.raises(SageMakerTieredStorageError, match="Invalid step value"):
        SageMakerTieredStorageWriter(cfg(namespace=""), step=-2)


def test_errors_share_tierckpts_root() -> None:
    for cls in (SageMakerTieredStorageError, SageMakerInMemoryTierError, SageMakerS3TierError, SageMakerTieredStorageConfigError):
        assert issubclass(cls, SageMakerTieredStorageError) and issubclass(cls, TierckptError)
    assert issubclass(SageMakerTieredStorageConfigError, ConfigError)


def test_save_to_s3_is_read_when_the_writer_is_built(memory_dir: str) -> None:
    config = cfg(world_size=1, s3_tier_base_path="s3://bucket/x", save_to_s3=True, memory_dir=memory_dir)
    writer = SageMakerTieredStorageWriter(config, step=1)
    config.save_to_s3 = False  # the README flips it for the next step while this save runs
    assert writer.durable and writer.save_to_s3
