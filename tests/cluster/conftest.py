"""Fixtures for the namespaced-host tests: ``cluster`` (a ``hosts.Cluster`` closed after the test,
also when it failed), skipped with the reason when this machine cannot make namespaces."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import hosts


@pytest.fixture(scope="session")
def namespaces() -> None:
    reason = hosts.unavailable()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def cluster(namespaces: None, tmp_path: Path) -> Iterator[hosts.Cluster]:
    made = hosts.Cluster(tmp_path / "cluster")
    try:
        yield made
    finally:
        made.close()
