"""Shared fixtures: a private memory-tier root on tmpfs and a durable directory."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Any]:
    """A factory of real, tiny tmpfs mounts (``make(size='4m', ro=False)``), unmounted after.

    Skips the test where mounting is not permitted (not root, no CAP_SYS_ADMIN).
    """
    mounted: list[Path] = []

    def make(size: str = "4m", *, ro: bool = False) -> Path:
        where = tmp_path / f"tmpfs-{len(mounted)}"
        where.mkdir()
        opts = f"size={size}" + (",ro" if ro else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip() or done.returncode}")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``make test-slow`` runs the scenario tier on two pytest-xdist workers (``--dist loadgroup``):
    the namespaced-host tests (``tests/cluster``: bridges, a real slurmctld) stay on one worker,
    one after another, and so do the benchmarks (they measure: one at a time); the loopback
    scenarios share the other worker and fill in. Without xdist the marks do nothing."""
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path.startswith("tests/cluster/"):
            item.add_marker(pytest.mark.xdist_group("hosts"))
        elif path.startswith("tests/bench/") or path.endswith("_bench.py"):
            item.add_marker(pytest.mark.xdist_group("bench"))
