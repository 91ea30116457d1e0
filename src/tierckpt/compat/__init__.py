"""Drop-in shims for other checkpointing libraries' APIs, mapped onto tierckpt.

``tierckpt.compat.sagemaker``: the SageMaker HyperPod tiered-checkpointing classes
(``SageMakerCheckpointConfig``, ``SageMakerTieredStorageWriter``, ``SageMakerTieredStorageReader``,
``DefaultS3PathStrategy``, ``RayS3PathStrategy``); ``legacy`` reads checkpoints that library
wrote to S3 and ``importer`` (``tierckpt import``) converts them to tierckpt steps.
"""
