"""Fixtures for the launcher scenarios: fresh memory roots on /dev/shm, one per simulated node."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest


@pytest.fixture
def shm() -> Iterator[Callable[[str], str]]:
    made: list[str] = []

    def make(tag: str = "node") -> str:
        path = tempfile.mkdtemp(prefix=f"tierckpt-run-{tag}-", dir="/dev/shm")
        made.append(path)
        return path

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)
