"""tierckpt: tiered checkpointing and fast recovery for PyTorch distributed training.

    import tierckpt
    cfg = tierckpt.CheckpointConfig(namespace="run1", durable_url="file:///mnt/ckpt")
    with tierckpt.Checkpointer(cfg) as ck:
        start = ck.load(state_dict)          # None when there is nothing to resume
        ck.save(step, state_dict)            # memory now, durable in the background

The DCP plug-ins ``TieredStorageWriter`` / ``TieredStorageReader`` work with
``dcp.save``, ``dcp.async_save`` and ``dcp.load``. ``tierckpt.resilient(train)`` restarts a
training function in-process on a fault (``tierckpt.inprocess``).
"""

from tierckpt.checkpointer import Checkpointer, SaveHandle, StepInfo
from tierckpt.config import CheckpointConfig, S3Settings
from tierckpt.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt.errors import (
    CheckpointFailedError,
    CheckpointNotFoundError,
    ConfigError,
    DurableWriteError,
    IntegrityError,
    MemoryBudgetError,
    NoUsableStepError,
    SnapshotChangedError,
    StateDictMismatchError,
    StorageError,
    TierckptError,
    UnsafeObjectError,
    UnsaveableObjectError,
)
from tierckpt.inprocess import Generation, resilient

__version__ = "0.2.0"

__all__ = [
    "CheckpointConfig",
    "CheckpointFailedError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "ConfigError",
    "DurableWriteError",
    "Generation",
    "IntegrityError",
    "MemoryBudgetError",
    "NoUsableStepError",
    "S3Settings",
    "SaveHandle",
    "SnapshotChangedError",
    "StateDictMismatchError",
    "StepInfo",
    "StorageError",
    "TierckptError",
    "TieredStorageReader",
    "TieredStorageWriter",
    "UnsafeObjectError",
    "UnsaveableObjectError",
    "resilient",
]
