"""The conformance suite every Tier inherits: subclass it and provide a ``tier`` fixture.

    class TestMyTier(TierContract):
        @pytest.fixture
        def tier(self): return MyTier(...)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tierckpt import layout
from tierckpt.errors import CheckpointNotFoundError, IntegrityError, StorageError
from tierckpt.tiers import Tier
from tierckpt.tiers.integrity import sealed_manifest

PAYLOAD = bytes(range(256)) * 4099  # ~1 MiB, not a multiple of any part size


def _manifest(tier: Tier, step: int, save_id: str, files: dict[str, int]) -> bytes:
    return layout.Manifest(
        namespace=getattr(tier, "namespace", "contract"), step=step, save_id=save_id, world_size=1,
        metadata_xxh3=layout.checksum(b"md"), files=files,
    ).to_bytes()


def commit(tier: Tier, step: int, payload: bytes = PAYLOAD, save_id: str = "s1", source: Path | None = None) -> None:
    tier.put_file(step, save_id, "__0_0.distcp", source if source is not None else payload)
    tier.commit(step, save_id, {layout.METADATA: b"md", layout.MANIFEST: _manifest(tier, step, save_id, {"__0_0.distcp": len(payload)})})


class TierContract:
    def test_empty(self, tier: Tier) -> None:
        assert tier.list_steps() == []
        with pytest.raises(CheckpointNotFoundError):
            tier.read_file(1, layout.MANIFEST)

    def test_uncommitted_is_invisible(self, tier: Tier) -> None:
        tier.put_file(3, "s1", "__0_0.distcp", PAYLOAD)
        assert tier.list_steps() == []

    def test_commit_then_read(self, tier: Tier) -> None:
        commit(tier, 3)
        [listing] = tier.list_steps()
        assert listing.step == 3 and listing.committed
        assert listing.files["__0_0.distcp"] == len(PAYLOAD)
        assert tier.read_file(3, layout.METADATA) == b"md"
        assert bytes(tier.read_range(3, "__0_0.distcp", 1000, 5000)) == PAYLOAD[1000:6000]
        assert bytes(tier.read_range(3, "__0_0.distcp", 0, len(PAYLOAD))) == PAYLOAD
        assert sealed_manifest(tier, 3, getattr(tier, "namespace", "contract")).save_id == "s1"

    def test_put_from_file(self, tier: Tier, tmp_path: Path) -> None:
        src = tmp_path / "src.bin"
        src.write_bytes(PAYLOAD[::-1])
        commit(tier, 4, PAYLOAD[::-1], source=src)
        assert bytes(tier.read_range(4, "__0_0.distcp", 0, len(PAYLOAD))) == PAYLOAD[::-1]

    def test_steps_sorted_numerically(self, tier: Tier) -> None:
        for step in (10, 2, 33):
            commit(tier, step, b"x" * 10)
        assert [s.step for s in tier.list_steps()] == [2, 10, 33]

    def test_resave_replaces(self, tier: Tier) -> None:
        commit(tier, 5, b"old" * 100, save_id="a")
        commit(tier, 5, b"new" * 100, save_id="b")
        assert bytes(tier.read_range(5, "__0_0.distcp", 0, 300)) == b"new" * 100
        assert sealed_manifest(tier, 5, getattr(tier, "namespace", "contract")).save_id == "b"

    def test_delete_removes_marker_and_data(self, tier: Tier) -> None:
        commit(tier, 1)
        commit(tier, 2)
        tier.delete(1)
        tier.delete(99)  # absent: ignored
        assert [s.step for s in tier.list_steps(include_uncommitted=True)] == [2]

    def test_short_read_is_an_error(self, tier: Tier) -> None:
        commit(tier, 1, b"abc")
        with pytest.raises(StorageError):
            tier.read_range(1, "__0_0.distcp", 0, 10)

    def test_marker_seals_manifest(self, tier: Tier) -> None:
        commit(tier, 1)
        other = _manifest(tier, 1, "forged", {"__0_0.distcp": 1})
        with pytest.raises(IntegrityError):
            layout.check_marker(tier.read_file(1, layout.MARKER), other, where="test")
