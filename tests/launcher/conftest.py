"""Fixtures for the launcher scenarios: fresh memory roots on /dev/shm, one per simulated node,
and ``make_job`` (a ``LocalJob`` closed, with every process it started, after the test)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.launcher.cluster import LocalJob


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


@pytest.fixture
def make_job(tmp_path: Path, shm: Callable[[str], str]) -> Iterator[Callable[..., LocalJob]]:
    jobs: list[LocalJob] = []

    def make(**kw: Any) -> LocalJob:
        job = LocalJob(tmp_path / f"job{len(jobs)}", shm, **kw)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()
