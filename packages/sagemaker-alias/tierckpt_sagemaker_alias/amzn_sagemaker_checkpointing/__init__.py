"""NOT Amazon's amzn-sagemaker-checkpointing: tierckpt's alias of it (distribution tierckpt-sagemaker-alias).

``import amzn_sagemaker_checkpointing...`` lines written for SageMaker HyperPod's tiered
checkpointing load ``tierckpt.compat.sagemaker`` instead, unchanged: the memory tier is node-local
shared memory and S3 is written in the library's own layout (tierckpt's ``docs/compat.md``).
Installed only on request (``pip install 'tierckpt[sagemaker-alias]'``), and it refuses to hide
the real package: when that is installed it is found first, and importing this one anyway raises
``tierckpt.compat.alias.AliasShadowsPackageError``. The module names the seed's pages import:

    amzn_sagemaker_checkpointing.config.sagemaker_checkpoint_config    SageMakerCheckpointConfig (+ CheckpointConfig)
    amzn_sagemaker_checkpointing.config.s3_path_strategy               Default/RayS3PathStrategy
    amzn_sagemaker_checkpointing.checkpointing.filesystem[.filesystem] SageMakerTieredStorageWriter/Reader
    amzn_sagemaker_checkpointing.checkpointing.filesystem.exceptions   SageMaker*Error

This package itself also has those names (``import amzn_sagemaker_checkpointing as sm_ckpt``).
"""

from typing import Any

from tierckpt.compat.alias import refuse_to_shadow

refuse_to_shadow(__file__)

__tierckpt_alias__ = True
__version__ = "1.0+tierckpt"

_EXPORTS = {
    "CheckpointConfig": "tierckpt.compat.sagemaker_config",
    "SageMakerCheckpointConfig": "tierckpt.compat.sagemaker_config",
    "SageMakerTieredStorageReader": "tierckpt.compat.sagemaker",
    "SageMakerTieredStorageWriter": "tierckpt.compat.sagemaker",
    "DefaultS3PathStrategy": "tierckpt.compat.sagemaker_paths",
    "RayS3PathStrategy": "tierckpt.compat.sagemaker_paths",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:  # lazy: importing a submodule need not load torch twice over
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} (tierckpt's alias) has no attribute {name!r}")
