from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

import tierckpt
from tierckpt import IntegrityError
from tierckpt.record import dumps_metadata, loads_metadata, tensor_record


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool, torch.complex64, torch.float64])
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 5), (2, 3, 4)])
def test_record_is_a_torch_save_archive(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = (torch.rand(shape) * 100).to(dtype)
    rec = tensor_record(dtype, shape)
    raw = rec.prefix + t.reshape(-1).view(torch.uint8).numpy().tobytes() + rec.suffix
    assert len(raw) == rec.length and (t.numel() == 0 or rec.data_offset % 64 == 0)
    loaded = torch.load(io.BytesIO(raw), weights_only=True)
    assert loaded.dtype == dtype and loaded.shape == t.shape and torch.equal(loaded, t)


class _Evil:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("true",))


def test_metadata_unpickler_refuses_foreign_globals() -> None:
    with pytest.raises(IntegrityError, match="not allowed"):
        loads_metadata(pickle.dumps(_Evil()))
    with pytest.raises(IntegrityError, match="cannot be read"):
        loads_metadata(b"garbage")


def test_metadata_round_trip() -> None:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    md = Metadata(state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([2, 3]),
                                                                  [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3]))])},
                  storage_data={MetadataIndex("w", torch.Size([0, 0]), 0): None})
    back = loads_metadata(dumps_metadata(md))
    assert back.state_dict_metadata["w"].properties.dtype == torch.bfloat16


def test_public_surface_is_frozen() -> None:
    assert tierckpt.__all__ == sorted(tierckpt.__all__)
    assert set(tierckpt.__all__) == {
        "CheckpointConfig", "CheckpointFailedError", "CheckpointNotFoundError", "Checkpointer", "ConfigError",
        "DurableWriteError", "UnsaveableObjectError", "UnsafeObjectError", "SnapshotChangedError",
        "IntegrityError", "MemoryBudgetError", "NoUsableStepError", "S3Settings", "SaveHandle", "StateDictMismatchError", "StepInfo",
        "StorageError", "TieredStorageReader", "TieredStorageWriter", "TierckptError", "Generation", "resilient",
    }
    for name in tierckpt.__all__:
        obj = getattr(tierckpt, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, tierckpt.TierckptError)
    assert issubclass(tierckpt.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(tierckpt.ConfigError, ValueError)
    assert issubclass(tierckpt.NoUsableStepError, tierckpt.CheckpointNotFoundError)


def test_config_fields_are_frozen() -> None:
    import dataclasses

    assert [f.name for f in dataclasses.fields(tierckpt.CheckpointConfig)] == [
        "namespace", "memory_dir", "durable_url", "memory_steps_retained", "durable_every_n_steps",
        "durable_steps_retained", "memory_budget_bytes", "node_memory_budget", "io_threads", "local_mode", "s3", "logger",
        "trusted", "allowed_classes", "resume_before",
    ]


def test_errors_survive_pickling_with_context() -> None:
    err = tierckpt.IntegrityError("bad", tier="memory", step=3, rank=1)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is tierckpt.IntegrityError and (back.tier, back.step, back.rank, str(back)) == ("memory", 3, 1, "bad")
    unusable = tierckpt.NoUsableStepError("none", steps=(2, 3), missing={3: "rank 1 has no copy"}, rank=0)
    back_u = pickle.loads(pickle.dumps(unusable))
    assert type(back_u) is tierckpt.NoUsableStepError
    assert (back_u.steps, back_u.missing, back_u.rank, str(back_u)) == ((2, 3), {3: "rank 1 has no copy"}, 0, "none")
