"""tierckpt alias of the library's S3 path strategies (``tierckpt.compat.sagemaker_paths``)."""

from tierckpt.compat.sagemaker_paths import DefaultS3PathStrategy, RayS3PathStrategy, S3PathStrategy

__all__ = ["DefaultS3PathStrategy", "RayS3PathStrategy", "S3PathStrategy"]
