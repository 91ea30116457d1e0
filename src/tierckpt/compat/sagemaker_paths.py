"""The SageMaker library's S3 path strategies: where its checkpoints live on S3.

``amzn-sagemaker-checkpointing`` writes each rank's data as one object and the coordinator's
metadata beside rank 0's, in one of two layouts:

    DefaultS3PathStrategy   {base}/{namespace}/rank_{R}/step_{N}/checkpoint.pt
                            {base}/{namespace}/rank_0/step_{N}/metadata.metadata
    RayS3PathStrategy       {base}/{namespace}/step_{N}/rank_{R}/checkpoint.pt   (inside Ray Train)

The drop-in writes these layouts by default (``s3_layout="sagemaker"``,
``tierckpt.compat.sagemaker_write``); the strategies also name a step's directory
(``s3_checkpoint_dir``) and find and read the library's checkpoints (``tierckpt.compat.legacy``).
With ``s3_layout="tierckpt"`` it writes tierckpt's own ``{base}/{namespace}/step_{N}/`` instead. Same names, signatures and errors as the
library's ``amzn_sagemaker_checkpointing.config.s3_path_strategy``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

from tierckpt.errors import TierckptError

__all__ = [
    "DefaultS3PathStrategy",
    "RayS3PathStrategy",
    "S3PathStrategy",
    "StrategyNotSupportedError",
    "detect_default_strategy",
]


class StrategyNotSupportedError(TierckptError, NotImplementedError):
    """The strategy has no such directory (the library raises NotImplementedError here too)."""


class S3PathStrategy(ABC):
    """Where a namespace's files go under ``base_path`` (an ``s3://bucket/prefix`` URL)."""

    def __init__(self, base_path: str, logger: logging.Logger | None = None) -> None:
        self.base_path = base_path
        self._logger = logger or logging.getLogger(__name__)

    @abstractmethod
    def get_s3_uri(self, namespace: str, rank: int, step: int, filename: str) -> str:
        """The full S3 URI of one rank's file of one step."""

    @abstractmethod
    def get_checkpoint_dir(self, namespace: str, step: int) -> str:
        """The S3 directory holding every rank's shard of a step (where one exists)."""

    @abstractmethod
    def find_step_ranks(
        self, paginator: Any, bucket: str, base_prefix: str, namespace: str, world_size: int, log_prefix: str = ""
    ) -> dict[int, set[int]]:
        """{step: ranks with files} found by listing with a boto3 ``list_objects_v2`` paginator."""

    def _parse(self, prefix: str, marker: str) -> int | None:
        if f"/{marker}_" not in prefix:
            return None
        try:
            return int(prefix.split(f"/{marker}_")[1].rstrip("/").split("/")[0])
        except (ValueError, IndexError):
            self._logger.debug("Failed to parse %s from prefix: %s", marker, prefix)
            return None

    def _parse_step(self, prefix: str) -> int | None:
        return self._parse(prefix, "step")

    @staticmethod
    def _children(paginator: Any, bucket: str, prefix: str) -> list[str]:
        return [
            info["Prefix"]
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix, Delimiter="/")
            for info in page.get("CommonPrefixes", [])
        ]


def _ns_prefix(base_prefix: str, namespace: str) -> str:
    return f"{base_prefix}/{namespace}/" if base_prefix else f"{namespace}/"


class DefaultS3PathStrategy(S3PathStrategy):
    """``{base}/{namespace}/rank_{R}/step_{N}/{file}``: each rank's steps under its own prefix."""

    def get_s3_uri(self, namespace: str, rank: int, step: int, filename: str) -> str:
        return f"{self.base_path}/{namespace}/rank_{rank}/step_{step}/{filename}"

    def get_checkpoint_dir(self, namespace: str, step: int) -> str:
        raise StrategyNotSupportedError(
            "DefaultS3PathStrategy does not support get_checkpoint_dir. "
            "Shards are scattered across rank subdirectories. Use RayS3PathStrategy for Ray Train integration."
        )

    def find_step_ranks(
        self, paginator: Any, bucket: str, base_prefix: str, namespace: str, world_size: int, log_prefix: str = ""
    ) -> dict[int, set[int]]:
        step_ranks: dict[int, set[int]] = {}
        for rank in range(world_size):
            prefix = f"{_ns_prefix(base_prefix, namespace)}rank_{rank}/"
            self._logger.debug("%s Searching with rank_prefix: '%s'", log_prefix, prefix)
            for child in self._children(paginator, bucket, prefix):
                step = self._parse_step(child)
                if step is not None:
                    step_ranks.setdefault(step, set()).add(rank)
        return step_ranks


class RayS3PathStrategy(S3PathStrategy):
    """``{base}/{namespace}/step_{N}/rank_{R}/{file}``: a step's shards under one directory."""

    def get_s3_uri(self, namespace: str, rank: int, step: int, filename: str) -> str:
        return f"{self.base_path}/{namespace}/step_{step}/rank_{rank}/{filename}"

    def get_checkpoint_dir(self, namespace: str, step: int) -> str:
        return f"{self.base_path}/{namespace}/step_{step}"

    def find_step_ranks(
        self, paginator: Any, bucket: str, base_prefix: str, namespace: str, world_size: int, log_prefix: str = ""
    ) -> dict[int, set[int]]:
        step_ranks: dict[int, set[int]] = {}
        for child in self._children(paginator, bucket, _ns_prefix(base_prefix, namespace)):
            step = self._parse_step(child)
            if step is not None:
                step_ranks[step] = set()
        for step in step_ranks:
            for child in self._children(paginator, bucket, f"{_ns_prefix(base_prefix, namespace)}step_{step}/"):
                rank = self._parse_rank(child)
                if rank is not None:
                    step_ranks[step].add(rank)
        self._logger.debug("%s Found step_ranks: %s", log_prefix, step_ranks)
        return step_ranks

    def _parse_rank(self, prefix: str) -> int | None:
        return self._parse(prefix, "rank")


def in_ray_train() -> bool:
    """True inside a Ray Train worker (``ray.train.get_context()`` works there and raises elsewhere)."""
    try:
        from ray import train
    except ImportError:
        return False
    try:
        train.get_context()
    except RuntimeError:
        return False
    return True


def detect_default_strategy(base_path: str, logger: logging.Logger | None = None) -> S3PathStrategy:
    """The library's rule: RayS3PathStrategy inside Ray Train, else DefaultS3PathStrategy."""
    log = logger or logging.getLogger(__name__)
    if in_ray_train():
        log.debug("Detected Ray Train context, using RayS3PathStrategy with base_path=%s", base_path)
        return RayS3PathStrategy(base_path, logger)
    log.debug("Using DefaultS3PathStrategy with base_path=%s", base_path)
    return DefaultS3PathStrategy(base_path, logger)
