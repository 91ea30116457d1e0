"""tierckpt alias of the library's config module (``tierckpt.compat.sagemaker_config``)."""

from tierckpt.compat.sagemaker_config import CheckpointConfig, SageMakerCheckpointConfig

__all__ = ["CheckpointConfig", "SageMakerCheckpointConfig"]
