"""Drop-in shims for other checkpointing libraries' APIs, mapped onto tierckpt.

``tierckpt.compat.sagemaker``: the SageMaker HyperPod tiered-checkpointing classes
(``SageMakerCheckpointConfig``, ``SageMakerTieredStorageWriter``, ``SageMakerTieredStorageReader``).
"""
