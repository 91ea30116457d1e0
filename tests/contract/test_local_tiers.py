"""The Tier conformance suite on the local tiers: tmpfs memory and fsynced filesystem."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.contract.tier_contract import TierContract, commit
from tierckpt.tiers import LocalTier


class TestMemoryTier(TierContract):
    @pytest.fixture
    def tier(self, shm_root: Path) -> LocalTier:
        return LocalTier(shm_root, "contract", name="memory", durable=False)

    def test_data_file_is_a_link_to_the_source(self, tier: LocalTier, shm_root: Path) -> None:
        slot = shm_root / "slot"
        slot.write_bytes(b"z" * 100)
        commit(tier, 7, b"z" * 100, source=slot)
        assert slot.stat().st_nlink == 2  # no copy: the step's file is the slot
        tier.delete(7)
        assert slot.stat().st_nlink == 1


class TestFilesystemTier(TierContract):
    @pytest.fixture
    def tier(self, durable_dir: Path) -> LocalTier:
        return LocalTier(durable_dir, "contract", name="durable", durable=True)

    def test_copy_not_link(self, tier: LocalTier, tmp_path: Path) -> None:
        src = tmp_path / "s"
        src.write_bytes(b"q" * 50)
        commit(tier, 1, b"q" * 50, source=src)
        assert src.stat().st_nlink == 1

    def test_gc_removes_dead_writers_staging(self, tier: LocalTier) -> None:
        tier.put_file(9, "dead", "__0_0.distcp", b"x")
        staging = tier.staging_dir(9, "dead")
        for owner in staging.glob(".owner-*"):
            owner.rename(owner.with_name(owner.name.rsplit("-", 1)[0] + "-999999999"))
        assert tier.gc_staging() == [staging.name]
        assert not staging.exists()

    def test_gc_keeps_live_writers_staging(self, tier: LocalTier) -> None:
        tier.put_file(9, "live", "__0_0.distcp", b"x")
        assert tier.gc_staging() == []
