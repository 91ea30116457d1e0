"""The Tier conformance suite on the local tiers: tmpfs memory and fsynced filesystem."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from tests.contract.tier_contract import TierContract, commit
from tierckpt import layout
from tierckpt.tiers import LocalTier
from tierckpt.tiers import local as local_module
from tierckpt.tiers.integrity import sealed_manifest


class LocalCommitProtocol:
    """The local commit protocol, step by step: small files, then the marker, then one rename.

    Spies wrap the tier's own helpers (the real writes and renames still happen) and note, at
    each one, whether readers could already see the step as committed.
    """

    def _spy(self, tier: LocalTier, monkeypatch: pytest.MonkeyPatch, step: int) -> list[tuple[str, str, bool]]:
        events: list[tuple[str, str, bool]] = []

        def visible() -> bool:
            return step in [s.step for s in tier.list_steps()]

        def wrap(kind: str, real: Any, name_of: Any) -> Any:
            def spy(*args: Any, **kwargs: Any) -> Any:
                events.append((kind, name_of(*args), visible()))
                return real(*args, **kwargs)
            return spy

        monkeypatch.setattr(local_module, "_write_bytes", wrap("write", local_module._write_bytes, lambda p, *_: f"{p.parent.parent.name}/{p.name}"))
        monkeypatch.setattr(local_module, "_exchange", wrap("exchange", local_module._exchange, lambda a, b: b.name))
        monkeypatch.setattr(local_module, "_fsync_dir", wrap("fsync", local_module._fsync_dir, lambda p: p.name))
        monkeypatch.setattr(local_module.os, "rename", wrap("rename", local_module.os.rename, lambda a, b: Path(b).name))
        return events

    def test_commit_writes_small_files_then_the_marker_then_renames(self, tier: LocalTier, monkeypatch: pytest.MonkeyPatch) -> None:
        tier.put_file(4, "s1", "__0_0.distcp", b"x" * 10)
        events = self._spy(tier, monkeypatch, 4)
        commit_files = {layout.METADATA: b"md", layout.MANIFEST: _manifest(tier, 4, "s1", {"__0_0.distcp": 10})}
        tier.commit(4, "s1", commit_files)
        writes = [name for kind, name, _ in events if kind == "write"]
        assert writes == [f"{layout.STAGING}/.metadata", f"{layout.STAGING}/manifest.json", f"{layout.STAGING}/COMMITTED"]
        order = [kind for kind, _, _ in events if kind != "fsync" or tier.durable]
        expected = ["write", "write", "write", "rename"] if not tier.durable else ["write", "write", "write", "fsync", "rename", "fsync"]
        assert order == expected
        assert [vis for kind, _, vis in events if kind != "fsync"] == [False, False, False, False]  # visible only after the rename
        assert [s.step for s in tier.list_steps()] == [4]
        assert sealed_manifest(tier, 4, tier.namespace).save_id == "s1"

    def test_a_resave_swaps_the_whole_step_in_one_rename(self, tier: LocalTier, monkeypatch: pytest.MonkeyPatch) -> None:
        commit(tier, 5, b"old" * 10, save_id="s1")
        tier.put_file(5, "s2", "__0_0.distcp", b"new" * 10)
        events = self._spy(tier, monkeypatch, 5)
        tier.commit(5, "s2", {layout.METADATA: b"md", layout.MANIFEST: _manifest(tier, 5, "s2", {"__0_0.distcp": 30})})
        swap = [i for i, (kind, _, _) in enumerate(events) if kind in ("exchange", "rename")][0]
        assert [k for k, _, _ in events[:swap] if k == "write"] == ["write"] * 3  # the marker is written before the swap
        assert all(vis for _, _, vis in events[: swap + 1])  # the old copy stays loadable until the swap
        assert sealed_manifest(tier, 5, tier.namespace).save_id == "s2"
        assert bytes(tier.read_range(5, "__0_0.distcp", 0, 30)) == b"new" * 10

    def test_a_listed_committed_step_always_has_its_manifest_and_metadata(self, tier: LocalTier) -> None:
        done = threading.Event()

        def writer() -> None:
            try:
                for step in range(1, 41):
                    commit(tier, step, bytes([step]) * 1000, save_id=f"s{step}")
            finally:
                done.set()

        thread = threading.Thread(target=writer)
        thread.start()
        checked = 0
        while not done.is_set() or checked == 0:
            for listing in tier.list_steps():
                assert {layout.MANIFEST, layout.METADATA, layout.MARKER} <= set(listing.files), listing
                assert sealed_manifest(tier, listing.step, tier.namespace).step == listing.step
                assert tier.read_file(listing.step, layout.METADATA) == b"md"
                checked += 1
        thread.join()
        assert checked > 0 and [s.step for s in tier.list_steps()] == list(range(1, 41))


def _manifest(tier: LocalTier, step: int, save_id: str, files: dict[str, int]) -> bytes:
    return layout.Manifest(
        namespace=tier.namespace, step=step, save_id=save_id, world_size=1,
        metadata_xxh3=layout.checksum(b"md"), files=files,
    ).to_bytes()


class TestMemoryTier(TierContract, LocalCommitProtocol):
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


class TestFilesystemTier(TierContract, LocalCommitProtocol):
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
