"""Shared fixtures: a private memory-tier root on tmpfs and a durable directory."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def shm_root() -> Iterator[Path]:
    root = Path("/dev/shm") / f"tierckpt-test-{uuid.uuid4().hex[:10]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def durable_dir(tmp_path: Path) -> Path:
    d = tmp_path / "durable"
    d.mkdir()
    return d
