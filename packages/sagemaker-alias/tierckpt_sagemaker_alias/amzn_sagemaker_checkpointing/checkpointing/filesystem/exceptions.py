"""tierckpt alias of the library's errors (each also a ``tierckpt.TierckptError``)."""

from tierckpt.compat.sagemaker_config import (
    SageMakerInMemoryTierError,
    SageMakerS3TierError,
    SageMakerTieredStorageConfigError,
    SageMakerTieredStorageError,
)

__all__ = [
    "SageMakerInMemoryTierError",
    "SageMakerS3TierError",
    "SageMakerTieredStorageConfigError",
    "SageMakerTieredStorageError",
]
