"""Fixtures for the multi-process scenario tests: fresh tier roots per test, removed after."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def shm():
    """A factory of fresh directories on /dev/shm (one per simulated node), removed after."""
    made: list[str] = []

    def make(tag: str = "node") -> str:
        path = tempfile.mkdtemp(prefix=f"tierckpt-mp-{tag}-", dir="/dev/shm")
        made.append(path)
        return path

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def durable(tmp_path: Path) -> tuple[str, Path]:
    """A durable tier on disk: its ``file://`` URL and its root directory."""
    root = tmp_path / "durable"
    root.mkdir()
    return f"file://{root}", root
