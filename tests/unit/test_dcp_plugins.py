"""The DCP plug-ins under plain dcp.save / dcp.async_save / dcp.load, one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tierckpt
from tierckpt import CheckpointConfig, TieredStorageReader, TieredStorageWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def cfg(shm_root: Path, durable_dir: Path) -> CheckpointConfig:
    return CheckpointConfig(namespace="plug", memory_dir=str(shm_root), durable_url=f"file://{durable_dir}",
                            durable_every_n_steps=0)


def sd(v: float) -> dict:
    return {"w": torch.full((128, 16), float(v)), "i": torch.arange(10) * int(v), "meta": {"note": f"v={v}"}}


def empty() -> dict:
    return {"w": torch.zeros(128, 16), "i": torch.zeros(10, dtype=torch.int64), "meta": {"note": ""}}


def test_step_from_argument_path_and_checkpoint_id(cfg: CheckpointConfig, shm_root: Path) -> None:
    dcp.save(sd(1), storage_writer=TieredStorageWriter(cfg, step=100))
    dcp.save(sd(2), storage_writer=TieredStorageWriter(cfg, path="run/step_200"))
    dcp.save(sd(3), checkpoint_id="anything/step_300", storage_writer=TieredStorageWriter(cfg))
    # retention keeps the newest 2 committed steps in memory
    assert sorted(p.name for p in (shm_root / "plug").glob("step_*")) == ["step_200", "step_300"]
    for step, v in ((200, 2), (300, 3)):
        out = empty()
        reader = TieredStorageReader(cfg, step=step)
        dcp.load(out, storage_reader=reader)
        assert torch.equal(out["w"], sd(v)["w"]) and out["meta"]["note"] == f"v={v}" and reader.step == step
    out = empty()
    dcp.load(out, storage_reader=TieredStorageReader(cfg, path="x/step_300"))
    assert torch.equal(out["i"], sd(3)["i"])


def test_no_step_is_a_clear_error(cfg: CheckpointConfig) -> None:
    # checked before DCP's first collective: the caller gets tierckpt's error, not CheckpointException
    with pytest.raises(tierckpt.ConfigError, match="no step for this save"):
        dcp.save(sd(1), storage_writer=TieredStorageWriter(cfg, path="no-step-here"))
    with pytest.raises(tierckpt.ConfigError, match="no step for this save"):
        dcp.async_save(sd(1), storage_writer=TieredStorageWriter(cfg))
    with pytest.raises(tierckpt.TierckptError, match="names no step"):
        TieredStorageWriter(cfg).reset("somewhere/else")
    with pytest.raises(tierckpt.ConfigError):
        TieredStorageWriter(cfg, step=-5)


def test_durable_copy_is_complete_when_save_returns(cfg: CheckpointConfig, durable_dir: Path) -> None:
    dcp.save(sd(4), storage_writer=TieredStorageWriter(cfg, step=4, durable=True))
    step_dir = durable_dir / "plug" / "step_4"
    assert (step_dir / "COMMITTED").exists()
    out = empty()
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(step_dir)))  # plain DCP, no tierckpt reader
    assert torch.equal(out["w"], sd(4)["w"]) and torch.equal(out["i"], sd(4)["i"])
    assert out["meta"]["note"] == "v=4"


def test_memory_step_is_plain_dcp_too(cfg: CheckpointConfig, shm_root: Path) -> None:
    dcp.save(sd(5), storage_writer=TieredStorageWriter(cfg, step=5))
    out = empty()
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(shm_root / "plug" / "step_5")))
    assert torch.equal(out["w"], sd(5)["w"])


def test_async_save_is_a_snapshot(cfg: CheckpointConfig, durable_dir: Path) -> None:
    state = sd(6)
    writer = TieredStorageWriter(cfg, step=6, durable=True)
    fut = dcp.async_save(state, storage_writer=writer)
    state["w"].fill_(-1.0)  # changed right after the call: the checkpoint keeps the old values
    fut.result(timeout=120)
    assert (durable_dir / "plug" / "step_6" / "COMMITTED").exists()  # durable when the future resolves
    out = empty()
    dcp.load(out, storage_reader=TieredStorageReader(cfg))
    assert torch.equal(out["w"], torch.full((128, 16), 6.0))


def test_mismatched_state_dict(cfg: CheckpointConfig) -> None:
    dcp.save(sd(7), storage_writer=TieredStorageWriter(cfg, step=7))
    wrong = empty()
    wrong["w"] = torch.zeros(4, 4)
    with pytest.raises(CheckpointException) as info:  # plain dcp.load: DCP's planner reports it
        dcp.load(wrong, storage_reader=TieredStorageReader(cfg))
    (failure,) = [f[0] if isinstance(f, tuple) else f for f in info.value.failures.values()]
    assert isinstance(failure, ValueError)
    assert "Size mismatch between saved torch.Size([128, 16]) and current: torch.Size([4, 4]) for w" in str(failure)


def test_missing_step_and_empty_namespace(cfg: CheckpointConfig) -> None:
    with pytest.raises(CheckpointException, match="no checkpoint in any tier"):
        dcp.load(empty(), storage_reader=TieredStorageReader(cfg))
    dcp.save(sd(1), storage_writer=TieredStorageWriter(cfg, step=1))
    reader = TieredStorageReader(cfg, step=9)
    with pytest.raises(CheckpointException, match="step 9"):
        dcp.load(empty(), storage_reader=reader)
    assert isinstance(reader.failure, tierckpt.CheckpointNotFoundError)


def test_call_order_violations_are_protocol_errors(cfg: CheckpointConfig) -> None:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan

    from tierckpt.errors import ProtocolError

    writer = TieredStorageWriter(cfg, step=1)
    with pytest.raises(ProtocolError, match="before prepare_global_plan"):
        writer.write_data(SavePlan(items=[]), None).wait()  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="before write_data"):
        writer.finish(Metadata(state_dict_metadata={}), [])
