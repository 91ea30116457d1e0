"""The seed's set-up pages (000) run with only the import changed, and the compat writer's
``s3_layout="sagemaker"`` round-trips with amzn-sagemaker-checkpointing's own reader and writer.

Seed 000 calls ``dist_cp.save_state_dict(..., checkpoint_id=...)`` and ``load_state_dict(...,
checkpoint_id=...)``; torch 2.13's deprecated ``*_state_dict`` functions take no ``checkpoint_id``
(a TypeError with any storage), so the same calls are made through ``dcp.save`` / ``dcp.load``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import tempfile
from typing import Any

import pytest
import torch
from torch.distributed import checkpoint as dist_cp

from tests.s3.test_compat_sagemaker import assert_state, blank, model_state, s3_keys, sagemaker_library_save
from tierckpt.compat.sagemaker import (
    DefaultS3PathStrategy,
    RayS3PathStrategy,
    SageMakerCheckpointConfig,
    SageMakerTieredStorageConfigError,
    SageMakerTieredStorageError,
    SageMakerTieredStorageReader,
    SageMakerTieredStorageWriter,
)


# -- items 1-3: the step from checkpoint_id, the seed's keywords, checkpoint_id on read --------------
def test_seed_000_writer_without_a_step_takes_it_from_checkpoint_id_and_the_reader_honours_it(memory_dir: str) -> None:
    checkpoint_config = SageMakerCheckpointConfig(namespace="job-000", world_size=1, memory_dir=memory_dir)
    for step_number in (5, 10):
        smWriter = SageMakerTieredStorageWriter(checkpoint_config)  # "Basic writer (step specified in save call)"
        checkpoint_dir = f"step_{step_number}"
        dist_cp.save(state_dict=model_state(step_number), checkpoint_id=checkpoint_dir, storage_writer=smWriter)
        assert smWriter.step == step_number
    smWriter = SageMakerTieredStorageWriter(checkpoint_config, step=15)  # the step parameter takes precedence
    dist_cp.save(state_dict=model_state(15), checkpoint_id="step_99", storage_writer=smWriter)
    smWriter = SageMakerTieredStorageWriter(checkpoint_config)  # async_save stages before it reads checkpoint_id
    dist_cp.async_save(state_dict=model_state(12), checkpoint_id="ckpts/step_12", storage_writer=smWriter).result()
    assert smWriter.step == 12

    # memory keeps the newest 3 steps (10, 12, 15), like the seed's service
    smReader = SageMakerTieredStorageReader(config=checkpoint_config)  # the page's keyword
    state_dict = blank()
    dist_cp.load(state_dict=state_dict, checkpoint_id="step_10", storage_reader=smReader)
    assert_state(state_dict, 10)
    assert smReader.step == 10
    state_dict = blank()
    dist_cp.load(state_dict=state_dict, storage_reader=SageMakerTieredStorageReader(checkpoint_config))  # newest
    assert_state(state_dict, 15)
    state_dict = blank()  # an explicit reader step wins over checkpoint_id, as the writer's does
    dist_cp.load(state_dict=state_dict, checkpoint_id="step_10", storage_reader=SageMakerTieredStorageReader(checkpoint_config, 12))
    assert_state(state_dict, 12)


def test_a_save_with_no_step_anywhere_fails_with_the_seeds_message(memory_dir: str) -> None:
    writer = SageMakerTieredStorageWriter(SageMakerCheckpointConfig(namespace="j", world_size=1, memory_dir=memory_dir))
    with pytest.raises(SageMakerTieredStorageError, match=r"^Invalid step value, step:-1\. path:.*checkpoint_id='step_N'"):
        dist_cp.save(model_state(1), storage_writer=writer)
    writer = SageMakerTieredStorageWriter(SageMakerCheckpointConfig(namespace="j", world_size=1, memory_dir=memory_dir))
    with pytest.raises(SageMakerTieredStorageError, match=r"^Invalid step value, step:-1\. path:not-a-step"):
        dist_cp.save(model_state(1), storage_writer=writer, checkpoint_id="not-a-step")
    writer = SageMakerTieredStorageWriter(SageMakerCheckpointConfig(namespace="j", world_size=1, memory_dir=memory_dir))
    with pytest.raises(SageMakerTieredStorageError, match=r"^Invalid step value, step:-1\. path:;"):
        dist_cp.async_save(model_state(1), storage_writer=writer).result()  # no step anywhere: through the future


def test_the_seeds_keywords_and_positional_order(memory_dir: str) -> None:
    config = SageMakerCheckpointConfig(namespace="job-kw", world_size=1, memory_dir=memory_dir)
    assert SageMakerTieredStorageWriter(config, "runs/step_3", -1).step == 3  # (checkpoint_config, path, step)
    assert SageMakerTieredStorageWriter(config=config, step=4).step == 4
    assert SageMakerTieredStorageWriter(checkpoint_config=config, path="x", step=6).step == 6
    assert SageMakerTieredStorageReader(config, 7).requested == 7  # (checkpoint_config, step)
    assert SageMakerTieredStorageReader(config=config, step=8).step == 8
    with pytest.raises(SageMakerTieredStorageConfigError, match="once"):
        SageMakerTieredStorageReader(config, config=config)
    with pytest.raises(SageMakerTieredStorageConfigError, match="checkpoint_config must be a SageMakerCheckpointConfig"):
        SageMakerTieredStorageReader()


def test_an_unknown_s3_layout_is_a_config_error() -> None:
    with pytest.raises(SageMakerTieredStorageConfigError, match=r"s3_layout must be one of 'tierckpt', 'sagemaker'"):
        SageMakerCheckpointConfig(namespace="j", world_size=1, s3_layout="hyperpod")


# -- item 4: the seed's S3 format, both ways -------------------------------------------------------
def sagemaker_library_load(state_dict: dict[str, Any], base: str, namespace: str, layout: str, step: int | None) -> int:
    """Load with amzn-sagemaker-checkpointing's own reader; returns the step it chose.

    As in ``sagemaker_library_save``, only its transports are replaced: no HyperPod memory
    service (every call fails, so it reads S3) and boto3 on the local server for its CRT client.
    Its newest-step search lists with its own ``boto3.client("s3")`` (AWS_ENDPOINT_URL here).
    """
    reader_mod = pytest.importorskip("amzn_sagemaker_checkpointing.checkpointing.filesystem.reader")
    from amzn_sagemaker_checkpointing.config import s3_path_strategy as ref_paths
    from amzn_sagemaker_checkpointing.config.sagemaker_checkpoint_config import (
        SageMakerCheckpointConfig as RefConfig,
    )

    from tierckpt.config import S3Settings
    from tierckpt.tiers.s3 import make_client

    client = make_client(S3Settings())
    bucket = base[len("s3://"):].split("/", 1)[0]

    class NoMemoryService:
        def __getattr__(self, name: str) -> Any:
            def unavailable(*args: Any, **kwargs: Any) -> Any:
                raise ConnectionError("no HyperPod memory service on this machine")
            return unavailable

    class BotoStreams:
        @contextlib.contextmanager
        def create_read_stream(self, s3_uri: str) -> Any:
            yield io.BytesIO(client.get_object(Bucket=bucket, Key=s3_uri[len(f"s3://{bucket}/"):])["Body"].read())

    class LocalTransportReader(reader_mod.SageMakerTieredStorageReader):  # type: ignore[misc,name-defined]
        def _initialize_common(self, checkpoint_config: Any, step: int | None, class_type: str) -> None:
            self.checkpoint_config, self.rank, self.step = checkpoint_config, 0, step
            self.logger = logging.getLogger("sagemaker.reference")
            self.s3_strategy = checkpoint_config.get_s3_strategy()
            self.s3_client, self.client, self.region = BotoStreams(), NoMemoryService(), "us-east-1"

    strategy = (ref_paths.RayS3PathStrategy if layout == "ray" else ref_paths.DefaultS3PathStrategy)(base)
    config = RefConfig(namespace=namespace, world_size=1, s3_path_strategy=strategy)
    reader = LocalTransportReader(config, step=step)
    dist_cp.load(state_dict, storage_reader=reader)
    return int(reader.step)


@pytest.mark.s3
@pytest.mark.parametrize("layout", ["default", "ray"])
def test_the_sagemaker_layout_is_read_by_the_seed_and_by_tierckpt_after_the_node_is_gone(
    s3_env: dict[str, str], bucket: str, memory_dir: str, layout: str
) -> None:
    base = f"s3://{bucket}/ckpt"
    strategy: Any = RayS3PathStrategy(base) if layout == "ray" else DefaultS3PathStrategy(base)
    config = SageMakerCheckpointConfig(namespace="job-sm", world_size=1, s3_path_strategy=strategy,
                                       memory_dir=memory_dir, s3_layout="sagemaker")
    future = None
    for step in (10, 20, 30):
        config.save_to_s3 = step != 30  # step 30 stays in memory only
        if future is not None:
            future.result()
        future = dist_cp.async_save(model_state(step), storage_writer=SageMakerTieredStorageWriter(config, step=step))
    assert future is not None
    future.result()
    keys = s3_keys(bucket, "ckpt/")
    rank_step = "step_20/rank_0" if layout == "ray" else "rank_0/step_20"
    assert keys == sorted(f"ckpt/job-sm/{rs}/{f}" for rs in (rank_step, rank_step.replace("20", "10"))
                          for f in ("checkpoint.pt", "metadata.metadata"))

    for step in (None, 10):  # the seed's reader: the newest complete step, then an explicit one
        state_dict = blank()
        got = sagemaker_library_load(state_dict, base, "job-sm", layout, step)
        assert got == (step or 20)
        assert_state(state_dict, got)

    state_dict = blank()
    dist_cp.load(state_dict, storage_reader=SageMakerTieredStorageReader(config))
    assert_state(state_dict, 30)  # memory first
    shutil.rmtree(memory_dir)  # the node is replaced
    new_node = tempfile.mkdtemp(prefix="tierckpt-s3test-new-", dir="/dev/shm")
    try:
        config.memory_dir = new_node
        state_dict = blank()
        reader = SageMakerTieredStorageReader(config)
        dist_cp.load(state_dict, storage_reader=reader)
        assert_state(state_dict, 20)
        assert reader.step == 20
    finally:
        shutil.rmtree(new_node, ignore_errors=True)


@pytest.mark.s3
def test_the_seed_and_the_drop_in_side_by_side_on_one_namespace(s3_env: dict[str, str], bucket: str, memory_dir: str) -> None:
    base = f"s3://{bucket}/both"
    sagemaker_library_save(model_state(10), base, "job-mix", 10, "default")
    config = SageMakerCheckpointConfig(namespace="job-mix", world_size=1, s3_tier_base_path=base, save_to_s3=True,
                                       memory_dir=memory_dir, s3_layout="sagemaker")
    state_dict = blank()
    dist_cp.load(state_dict, storage_reader=SageMakerTieredStorageReader(config))
    assert_state(state_dict, 10)  # the team goes on from the seed's step ...
    dist_cp.save(model_state(20), storage_writer=SageMakerTieredStorageWriter(config, step=20))
    state_dict = blank()
    assert sagemaker_library_load(state_dict, base, "job-mix", "default", None) == 20  # ... and could go back
    assert_state(state_dict, 20)
    assert torch.equal(state_dict["model"]["layer.weight"], model_state(20)["model"]["layer.weight"])


def _drop_in_save_on_rank(rank: int, env: dict[str, str], base: str, memory_dir: str, step: int) -> int:
    import os

    from tests.s3.test_compat_sagemaker import sharded_state

    os.environ.update(env)
    config = SageMakerCheckpointConfig(namespace="job-sm2", world_size=2, s3_path_strategy=DefaultS3PathStrategy(base),
                                       memory_dir=memory_dir, save_to_s3=True, s3_layout="sagemaker")
    dist_cp.save(sharded_state(rank, step), storage_writer=SageMakerTieredStorageWriter(config, step=step))
    return rank


@pytest.mark.s3
@pytest.mark.slow
def test_two_ranks_write_the_sagemaker_layout_and_the_seed_reads_it_resharded(
    s3_env: dict[str, str], bucket: str, memory_dir: str
) -> None:
    """Two real gloo ranks save a DTensor through the drop-in; the seed's reader loads it on one."""
    from tests.helpers.dist import run_ranks
    from tierckpt.compat.legacy import LegacySource

    base = f"s3://{bucket}/two"
    assert run_ranks(_drop_in_save_on_rank, 2, dict(s3_env), base, memory_dir, 8, timeout=150) == [0, 1]
    assert {"two/job-sm2/rank_0/step_8/checkpoint.pt", "two/job-sm2/rank_1/step_8/checkpoint.pt",
            "two/job-sm2/rank_0/step_8/metadata.metadata"} == set(s3_keys(bucket, "two/"))
    metadata = LegacySource(DefaultS3PathStrategy(base), "job-sm2").metadata(8)
    assert metadata is not None
    assert {i.rank for idx, i in metadata.storage_data.items() if idx.fqn == "model.layer.weight"} == {0, 1}
    state_dict = blank()
    assert sagemaker_library_load(state_dict, base, "job-sm2", "default", 8) == 8
    assert_state(state_dict, 8)
