"""PyTorch DCP plug-ins: ``TieredStorageWriter`` and ``TieredStorageReader``."""

from tierckpt.dcp.reader import TieredStorageReader
from tierckpt.dcp.writer import TieredStorageWriter

__all__ = ["TieredStorageReader", "TieredStorageWriter"]
