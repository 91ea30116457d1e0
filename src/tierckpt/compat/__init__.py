"""Drop-in shims for other checkpointing libraries' APIs, mapped onto tierckpt.

``tierckpt.compat.sagemaker``: the SageMaker HyperPod tiered-checkpointing classes
(``SageMakerCheckpointConfig``, ``SageMakerTieredStorageWriter``, ``SageMakerTieredStorageReader``,
``DefaultS3PathStrategy``, ``RayS3PathStrategy``); ``legacy`` reads checkpoints that library
wrote to S3 and ``importer`` (``tierckpt import``) converts them to tierckpt steps; ``alias``
guards the opt-in ``amzn_sagemaker_checkpointing`` alias (``packages/sagemaker-alias``).
``tierckpt.compat.smp``: SageMaker model parallelism's checkpoint calls (``async_save``, ``load``,
``init_optim_state``, ...) over a ``checkpoint_id``.
"""
