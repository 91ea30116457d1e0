"""tierckpt alias of the library's storage-info record (the ``metadata.metadata`` entries)."""

from tierckpt.compat.legacy import SageMakerStorageInfo as _SageMakerStorageInfo

__all__ = ["_SageMakerStorageInfo"]
