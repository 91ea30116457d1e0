"""Storage tiers behind one small protocol; ``open_durable`` picks the backend by URL."""

from __future__ import annotations

from pathlib import Path

from tierckpt.config import CheckpointConfig
from tierckpt.errors import ConfigError
from tierckpt.tiers.base import Source, StepListing, Tier
from tierckpt.tiers.local import LocalTier

__all__ = ["LocalTier", "Source", "StepListing", "Tier", "open_durable", "open_memory"]


def open_memory(config: CheckpointConfig) -> LocalTier:
    """The node-local memory tier (a directory on tmpfs; no fsync, data files linked)."""
    return LocalTier(Path(config.memory_dir), config.namespace, name="memory", durable=False)


def open_durable(config: CheckpointConfig) -> Tier | None:
    """The durable tier named by ``config.durable_url``, or None when memory-only."""
    loc = config.durable
    if loc is None:
        return None
    if loc.scheme == "file":
        if loc.path is None:  # parse() gives every file:// URL a path; keep the type narrow without assert
            raise ConfigError(f"durable_url {config.durable_url!r} names no directory")
        return LocalTier(loc.path, config.namespace, name="durable", durable=True)
    from tierckpt.tiers.s3 import S3Tier  # lazy: boto3 is an optional dependency

    return S3Tier.from_config(config)
