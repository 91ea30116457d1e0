"""``tierckpt.compat.sagemaker``: the seed's README examples with only the import changed, the
seed's validation messages word for word, its S3 path strategies, and checkpoints written by the
seed itself (amzn-sagemaker-checkpointing 1.1.3) read back and converted by ``tierckpt import``."""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import async_save, load, save
from torch.distributed.checkpoint.api import CheckpointException

from tierckpt import CheckpointNotFoundError, ConfigError, IntegrityError, TierckptError
from tierckpt.compat.sagemaker import (
    DefaultS3PathStrategy,
    RayS3PathStrategy,
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
        assert set(reader.tiers_used.values()) == {"s3 (SageMaker layout)"}  # the drop-in's default layout
        reader = SageMakerTieredStorageReader(checkpoint_config=checkpoint_config, step=30)
        with pytest.raises(CheckpointException):  # not in S3 nor in the new node's memory
            load(blank(), storage_reader=reader)
        assert isinstance(reader.failure, CheckpointNotFoundError) and reader.failure.step == 30
        assert "step 30" in str(reader.failure) and "does not exist" in str(reader.failure)
    finally:
        shutil.rmtree(new_node, ignore_errors=True)


@pytest.mark.s3
def test_sync_save_with_a_path_and_s3_checkpoint_dir(s3_env: dict[str, str], bucket: str, memory_dir: str) -> None:
    config = SageMakerCheckpointConfig(namespace="job-sync", world_size=1, s3_tier_base_path=f"s3://{bucket}/base/",
                                       save_to_s3=True, memory_dir=memory_dir)
    writer = SageMakerTieredStorageWriter(config, path="/runs/step_7/ckpt")
    assert writer.step == 7 and writer.rank == 0
    with pytest.raises(NotImplementedError, match="DefaultS3PathStrategy does not support get_checkpoint_dir"):
        _ = writer.s3_checkpoint_dir  # as in the seed: the default layout scatters shards
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
    reader = SageMakerTieredStorageReader(config)
    with pytest.raises(CheckpointException):
        load(blank(), storage_reader=reader)
    assert isinstance(reader.failure, CheckpointNotFoundError) and "no checkpoint" in str(reader.failure)


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


@pytest.mark.parametrize("path, step", [("step_7.pt", -1), ("", -5)])
def test_invalid_step_has_the_seed_message(path: str, step: int) -> None:
    with pytest.raises(SageMakerTieredStorageError, match=r"^Invalid step value, step:-?\d+\. path:"):
        SageMakerTieredStorageWriter(cfg(), path=path, step=step)


def test_no_path_and_no_step_waits_for_checkpoint_id() -> None:
    writer = SageMakerTieredStorageWriter(cfg())  # the seed's docs: the step comes with dcp.save
    with pytest.raises(SageMakerTieredStorageError, match=r"^Invalid step value, step:-1\. path:"):
        _ = writer.step
    writer.reset("ckpts/step_12")
    assert writer.step == 12


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
    config.s3_layout = "tierckpt"
    ours = SageMakerTieredStorageWriter(config, step=1)
    config.save_to_s3 = False  # the README flips it for the next step while these saves run
    assert writer.save_to_s3 and writer.sagemaker_layout and not writer.durable  # S3 through the library's layout
    assert ours.save_to_s3 and ours.durable  # S3 through tierckpt's durable tier


# -- the S3 path strategies ------------------------------------------------------------------
def test_path_strategies_name_the_seeds_layouts() -> None:
    default, ray = DefaultS3PathStrategy("s3://b/base"), RayS3PathStrategy("s3://b/base")
    assert default.get_s3_uri("ns", 3, 100, "checkpoint.pt") == "s3://b/base/ns/rank_3/step_100/checkpoint.pt"
    assert ray.get_s3_uri("ns", 3, 100, "checkpoint.pt") == "s3://b/base/ns/step_100/rank_3/checkpoint.pt"
    assert ray.get_checkpoint_dir("ns", 100) == "s3://b/base/ns/step_100"
    with pytest.raises(NotImplementedError) as info:
        default.get_checkpoint_dir("ns", 100)
    assert isinstance(info.value, TierckptError)
    assert ray._parse_step("base/ns/step_12/") == 12 and ray._parse_rank("base/ns/step_12/rank_4/") == 4
    assert ray._parse_step("base/ns/step_x/") is None and default._parse_step("base/ns/rank_1/") is None


def test_ray_layout_is_chosen_inside_ray_train(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray is not installed here: a stand-in ``ray.train`` whose ``get_context`` works (inside a Ray
    Train worker) or raises RuntimeError (outside), as Ray's does."""
    import sys
    import types

    assert isinstance(cfg(s3_tier_base_path="s3://b/p").get_s3_strategy(), DefaultS3PathStrategy)
    ray, train = types.ModuleType("ray"), types.ModuleType("ray.train")
    inside = {"yes": True}

    def get_context() -> object:
        if not inside["yes"]:
            raise RuntimeError("not in a Ray Train worker")
        return object()

    train.get_context = get_context  # type: ignore[attr-defined]
    ray.train = train  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.train", train)
    config = cfg(s3_tier_base_path="s3://bkt/p", world_size=1)
    strategy = config.get_s3_strategy()
    assert isinstance(strategy, RayS3PathStrategy) and strategy.base_path == "s3://bkt/p"
    assert SageMakerTieredStorageWriter(config, step=5).s3_checkpoint_dir == "s3://bkt/p/ns/step_5"
    inside["yes"] = False
    assert isinstance(config.get_s3_strategy(), DefaultS3PathStrategy)


# -- the reader's step ---------------------------------------------------------------------------
def test_reader_step_is_set_at_construction_and_read_data_fails_through_the_future(memory_dir: str) -> None:
    from torch.distributed.checkpoint.planner import LoadPlan

    config = SageMakerCheckpointConfig(namespace="job-step", world_size=1, memory_dir=memory_dir)
    assert SageMakerTieredStorageReader(config, step=12).step == 12
    reader = SageMakerTieredStorageReader(config)
    assert reader.step is None
    future = reader.read_data(LoadPlan(items=[]), None)  # type: ignore[arg-type]
    with pytest.raises(SageMakerTieredStorageError, match=r"^\[Rank 0\] Step None: Step must be set before calling read_data"):
        future.wait()


# -- checkpoints the seed itself wrote -------------------------------------------------------------
def sagemaker_library_save(state_dict: dict[str, Any], base: str, namespace: str, step: int, layout: str) -> None:
    """Save ``state_dict`` with amzn-sagemaker-checkpointing's own writer and ``dcp.save``.

    Its code decides the bytes, the object names and the metadata; only its transports are
    replaced, as they cannot run here: the HyperPod memory service (absent: every put fails, as
    on a node without it, and the writer goes on to S3) and its S3 client (s3torchconnector's
    CRT client with AWS's endpoint; here boto3 on the local server, one put per object).
    """
    writer_mod = pytest.importorskip("amzn_sagemaker_checkpointing.checkpointing.filesystem.writer")
    from amzn_sagemaker_checkpointing.config import s3_path_strategy as ref_paths
    from amzn_sagemaker_checkpointing.config.sagemaker_checkpoint_config import (
        SageMakerCheckpointConfig as RefConfig,
    )

    from tierckpt.config import S3Settings
    from tierckpt.tiers.s3 import make_client

    client = make_client(S3Settings())
    bucket = base[len("s3://"):].split("/", 1)[0]

    class NoMemoryService:
        def get_or_create_namespace(self) -> None:
            raise ConnectionError("no HyperPod memory service on this machine")

        def put_checkpoint(self, **kwargs: Any) -> None:
            raise ConnectionError("no HyperPod memory service on this machine")

    class BotoStreams:
        @contextlib.contextmanager
        def create_write_stream(self, s3_uri: str) -> Any:
            buf = io.BytesIO()
            yield buf
            client.put_object(Bucket=bucket, Key=s3_uri[len(f"s3://{bucket}/"):], Body=buf.getvalue())

    class LocalTransportWriter(writer_mod.SageMakerTieredStorageWriter):  # type: ignore[misc,name-defined]
        def _initialize_common(self, checkpoint_config: Any, step: int, class_type: str) -> None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            self.checkpoint_config, self.rank, self.step = checkpoint_config, rank, step
            self.logger = logging.getLogger("sagemaker.reference")
            self.s3_strategy = checkpoint_config.get_s3_strategy()
            self.s3_client, self.client, self.region = BotoStreams(), NoMemoryService(), "us-east-1"

    strategy = (ref_paths.RayS3PathStrategy if layout == "ray" else ref_paths.DefaultS3PathStrategy)(base)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    config = RefConfig(namespace=namespace, world_size=world, s3_path_strategy=strategy, save_to_s3=True)
    save(state_dict, storage_writer=LocalTransportWriter(config, step=step))


def s3_keys(bucket: str, prefix: str = "") -> list[str]:
    from tierckpt.config import S3Settings
    from tierckpt.tiers.s3 import make_client

    pages = make_client(S3Settings()).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


@pytest.mark.slow  # 20-33 s on the loaded 2-core box: a fresh interpreter with torch, or a seed round-trip
@pytest.mark.s3
@pytest.mark.parametrize("layout", ["default", "ray"])
def test_steps_the_seed_wrote_load_through_the_compat_reader(
    s3_env: dict[str, str], bucket: str, memory_dir: str, layout: str
) -> None:
    base = f"s3://{bucket}/old"
    for step in (10, 20):
        sagemaker_library_save(model_state(step), base, "job-old", step, layout)
    if layout == "ray":
        assert "old/job-old/step_20/rank_0/checkpoint.pt" in s3_keys(bucket)
        strategy: Any = RayS3PathStrategy(base)
    else:
        assert "old/job-old/rank_0/step_20/metadata.metadata" in s3_keys(bucket)
        strategy = DefaultS3PathStrategy(base)
    config = SageMakerCheckpointConfig(namespace="job-old", world_size=1, s3_path_strategy=strategy, memory_dir=memory_dir)
    state_dict = blank()
    reader = SageMakerTieredStorageReader(config)
    load(state_dict, storage_reader=reader)
    assert_state(state_dict, 20) and reader.step == 20
    state_dict = blank()
    load(state_dict, storage_reader=SageMakerTieredStorageReader(config, step=10))
    assert_state(state_dict, 10)
    # the team moves over: its next save is a tierckpt step, and the newest step wins from then on
    config.save_to_s3 = True
    save(model_state(30), storage_writer=SageMakerTieredStorageWriter(config, step=30))
    state_dict = blank()
    load(state_dict, storage_reader=SageMakerTieredStorageReader(config))
    assert_state(state_dict, 30)


@pytest.mark.s3
def test_a_doctored_seed_metadata_runs_nothing_and_is_skipped(
    s3_env: dict[str, str], bucket: str, memory_dir: str, tmp_path: Any
) -> None:
    import pickle

    from tierckpt.config import S3Settings
    from tierckpt.tiers.s3 import make_client

    base = f"s3://{bucket}/old"
    sagemaker_library_save(model_state(1), base, "job-evil", 1, "default")
    sagemaker_library_save(model_state(2), base, "job-evil", 2, "default")
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> Any:
            return (open, (str(marker), "w"))

    make_client(S3Settings()).put_object(Bucket=bucket, Key="old/job-evil/rank_0/step_2/metadata.metadata",
                                         Body=pickle.dumps(Payload()))
    config = SageMakerCheckpointConfig(namespace="job-evil", world_size=1, s3_tier_base_path=base, memory_dir=memory_dir)
    state_dict = blank()
    load(state_dict, storage_reader=SageMakerTieredStorageReader(config))
    assert_state(state_dict, 1)  # step 2's metadata was refused, step 1 loaded
    assert not marker.exists()
    # an object in the data itself: refused by name, through DCP's error, nothing runs
    sagemaker_library_save({**model_state(3), "extra": Payload()}, base, "job-evil", 3, "default")
    with pytest.raises(CheckpointException) as info:
        load({**blank(), "extra": None}, storage_reader=SageMakerTieredStorageReader(config, step=3))
    (failure,) = [f[0] if isinstance(f, tuple) else f for f in info.value.failures.values()]
    assert isinstance(failure, IntegrityError) and "'extra' holds an object a weights-only load refuses" in str(failure)
    assert not marker.exists()


@pytest.mark.s3
@pytest.mark.parametrize("layout", ["default", "ray"])
def test_tierckpt_import_converts_the_seeds_steps(
    s3_env: dict[str, str], bucket: str, tmp_path: Any, shm_factory: Any, capsys: pytest.CaptureFixture[str], layout: str
) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from tierckpt import CheckpointConfig, Checkpointer
    from tierckpt.cli import main as cli_main

    base = f"s3://{bucket}/old"
    for step in (5, 15):
        sagemaker_library_save(model_state(step), base, "job-mv", step, layout)
    dest = tmp_path / "converted"
    argv = ["import", base, "--source-namespace", "job-mv", "--layout", layout, "--to", f"file://{dest}"]
    assert cli_main([*argv, "--dry-run"]) == 0
    assert "step 5: would convert" in capsys.readouterr().out and not dest.exists()
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "step 5: converted" in out and "step 15: converted" in out and "2 step(s) converted" in out
    assert (dest / "job-mv" / "step_15" / "COMMITTED").exists()
    assert list(Path("/dev/shm").glob("tierckpt-import-*")) == []  # the scratch memory tier is gone
    # a tierckpt step: the Checkpointer resumes from it on a fresh node, and plain DCP reads it
    config = CheckpointConfig(namespace="job-mv", memory_dir=shm_factory(), durable_url=f"file://{dest}")
    with Checkpointer(config) as ck:
        state_dict = blank()
        assert ck.load(state_dict) == 15
        assert_state(state_dict, 15)
    state_dict = blank()
    load(state_dict, storage_reader=FileSystemReader(str(dest / "job-mv" / "step_5")))
    assert_state(state_dict, 5)
    assert cli_main(argv) == 0  # re-run: nothing left to do
    assert "0 step(s) converted" in capsys.readouterr().out
    assert cli_main([*argv, "--step", "99"]) == 3
    assert "step(s) [99] not found" in capsys.readouterr().err


def sharded_state(rank: int, step: int) -> dict[str, Any]:
    """On 2 gloo ranks: a DTensor sharded on dim 0 (one chunk per rank) and replicated values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = model_state(step)
    mesh = init_device_mesh("cpu", (2,))
    full["model"]["layer.weight"] = distribute_tensor(full["model"]["layer.weight"], mesh, [Shard(0)])
    return full


def _seed_save_on_rank(rank: int, env: dict[str, str], base: str, step: int, layout: str) -> int:
    import os

    os.environ.update(env)
    sagemaker_library_save(sharded_state(rank, step), base, "job-2r", step, layout)
    return rank


@pytest.mark.s3
@pytest.mark.slow
def test_a_two_rank_sharded_seed_checkpoint_loads_and_converts(
    s3_env: dict[str, str], bucket: str, memory_dir: str, tmp_path: Any, shm_factory: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two real gloo ranks save with the seed's writer; one process reads both ranks' blobs back."""
    from tests.helpers.dist import run_ranks
    from tierckpt import CheckpointConfig, Checkpointer
    from tierckpt.cli import main as cli_main

    base = f"s3://{bucket}/old"
    assert run_ranks(_seed_save_on_rank, 2, dict(s3_env), base, 8, "ray", timeout=150) == [0, 1]
    keys = s3_keys(bucket, "old/job-2r/step_8/")
    assert {"old/job-2r/step_8/rank_0/checkpoint.pt", "old/job-2r/step_8/rank_1/checkpoint.pt"} <= set(keys)
    from tierckpt.compat.legacy import LegacySource

    metadata = LegacySource(RayS3PathStrategy(base), "job-2r").metadata(8)
    assert metadata is not None
    weight_ranks = {info.rank for idx, info in metadata.storage_data.items() if idx.fqn == "model.layer.weight"}
    assert weight_ranks == {0, 1}  # one chunk in each rank's blob
    config = SageMakerCheckpointConfig(namespace="job-2r", world_size=1, s3_path_strategy=RayS3PathStrategy(base),
                                       memory_dir=memory_dir)
    state_dict = blank()
    load(state_dict, storage_reader=SageMakerTieredStorageReader(config))  # resharded: 2 ranks → 1
    assert_state(state_dict, 8)
    dest = tmp_path / "converted"
    assert cli_main(["import", base, "--source-namespace", "job-2r", "--layout", "ray", "--to", f"file://{dest}"]) == 0
    assert "step 8: converted" in capsys.readouterr().out
    with Checkpointer(CheckpointConfig(namespace="job-2r", memory_dir=shm_factory(), durable_url=f"file://{dest}")) as ck:
        state_dict = blank()
        assert ck.load(state_dict) == 8
        assert_state(state_dict, 8)
