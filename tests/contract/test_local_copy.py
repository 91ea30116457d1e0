"""``tiers/copy.py`` from a memory tier to a durable directory (``file://``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.contract.copy_contract import FILES, NS, CopyContract, memory_tier, pins_held, save_step
from tierckpt.errors import StorageError
from tierckpt.tiers import LocalTier
from tierckpt.tiers.copy import pin_files, put_files


@pytest.fixture
def node_root(tmp_path: Path) -> Callable[[str], str]:
    def make(tag: str) -> str:
        root = tmp_path / f"memory-{tag}"
        root.mkdir()
        return str(root)
    return make


@pytest.fixture
def durable(durable_dir: Path) -> LocalTier:
    return LocalTier(durable_dir, NS, name="durable", durable=True)


class TestLocalCopy(CopyContract):
    """The copy suite into a durable directory."""


def test_a_failed_put_releases_the_pins(durable: LocalTier, tmp_path: Path) -> None:
    memory = memory_tier(tmp_path / "memory")
    save_step(memory, 9)
    blocked = durable.staging_dir(9, "s1")
    blocked.parent.mkdir(parents=True)
    blocked.write_bytes(b"")  # a file where the staging directory goes: every put fails
    with pytest.raises(StorageError):
        put_files(durable, 9, "s1", pin_files(memory, 9, sorted(FILES)))
    assert pins_held(memory) == []
