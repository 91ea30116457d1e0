"""``tiers/copy.py`` from a memory tier on /dev/shm to the real S3 server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.contract.copy_contract import NS, CopyContract
from tierckpt.config import S3Settings
from tierckpt.tiers.s3 import S3Tier

pytestmark = pytest.mark.s3


@pytest.fixture
def node_root(shm_factory: Callable[[str], str]) -> Callable[[str], str]:
    return shm_factory


@pytest.fixture
def durable(s3_client: Any, bucket: str) -> Iterator[S3Tier]:
    tier = S3Tier(s3_client, bucket, "ckpt", NS, S3Settings(part_size=5 << 20, max_concurrency=4, max_attempts=3))
    yield tier
    tier.close()


class TestS3Copy(CopyContract):
    """The copy suite into S3."""
