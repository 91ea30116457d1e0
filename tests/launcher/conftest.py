"""Fixtures for the launcher scenarios: fresh memory roots on /dev/shm, one per simulated node,
and ``make_job`` (a ``LocalJob`` closed, with every process it started, after the test)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.launcher.cluster import LocalJob


@contextlib.contextmanager
def shm_dirs(prefix: str = "tierckpt-run") -> Iterator[Callable[[str], str]]:
    """A factory of fresh memory roots on /dev/shm (``make(tag)``), all removed on exit: for
    fixtures of any scope (module-scoped fault-free references use it too)."""
    made: list[str] = []

    def make(tag: str = "node") -> str:
        made.append(tempfile.mkdtemp(prefix=f"{prefix}-{tag}-", dir="/dev/shm"))
        return made[-1]

    try:
        yield make
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm() -> Iterator[Callable[[str], str]]:
    with shm_dirs() as make:
        yield make


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
