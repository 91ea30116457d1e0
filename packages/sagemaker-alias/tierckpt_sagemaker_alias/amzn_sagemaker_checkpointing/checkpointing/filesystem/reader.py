"""tierckpt alias of the library's DCP storage writer and reader (``tierckpt.compat.sagemaker``)."""

from tierckpt.compat.sagemaker import SageMakerTieredStorageReader, SageMakerTieredStorageWriter

__all__ = ["SageMakerTieredStorageReader", "SageMakerTieredStorageWriter"]
