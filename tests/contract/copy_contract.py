"""``tiers/copy.py`` on a real durable tier: subclass ``CopyContract`` and provide a ``durable``
fixture (a Tier for the namespace ``NS``) and a ``node_root`` fixture: ``node_root(tag)`` makes a
fresh directory that stands for one node's memory root.

The memory steps are built by hand (``save_step``), with an item checksum per half file, so a
test knows every byte and can hold back any file from any node.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tierckpt import layout
from tierckpt.errors import CheckpointNotFoundError, IntegrityError
from tierckpt.tiers import LocalTier, Tier
from tierckpt.tiers.copy import (
    check_files,
    commit_step,
    pin_files,
    put_files,
    release_pins,
    sealed_step,
    verify_step,
)
from tierckpt.tiers.integrity import sealed_manifest

NS = "copy-run"
METADATA = b"the step's .metadata"
#: a step's data files: not multiples of any part size, the second one empty of pattern
FILES = {"__0_0.distcp": bytes(range(256)) * 4099 + b"x", "__1_0.distcp": b"y" * 70001}


def memory_tier(root: str | Path) -> LocalTier:
    return LocalTier(Path(root), NS, name="memory", durable=False)


def save_step(memory: LocalTier, step: int, held: tuple[str, ...] | None = None, save_id: str = "s1") -> None:
    """Commit ``step`` of ``FILES`` in a memory tier that holds only ``held`` of them (all by default)."""
    items = []
    for name, data in FILES.items():
        half = len(data) // 2
        items += [layout.ItemRecord(name, 0, half, -1, layout.checksum(data[:half])),
                  layout.ItemRecord(name, half, len(data) - half, -1, layout.checksum(data[half:]))]
    manifest = layout.Manifest(namespace=memory.namespace, step=step, save_id=save_id, world_size=len(FILES),
                               metadata_xxh3=layout.checksum(METADATA),
                               files={n: len(d) for n, d in FILES.items()}, items=tuple(items))
    for name in FILES if held is None else held:
        memory.put_file(step, save_id, name, FILES[name])
    memory.commit(step, save_id, {layout.METADATA: METADATA, layout.MANIFEST: manifest.to_bytes()})


def pins_held(memory: LocalTier) -> list[str]:
    pins = memory.ns_dir / layout.PINS
    return sorted(p.name for p in pins.iterdir()) if pins.exists() else []


def committed(durable: Tier) -> list[int]:
    return [s.step for s in durable.list_steps()]


class CopyContract:
    @pytest.fixture
    def memory_root(self, node_root: Callable[[str], str]) -> str:
        return node_root("node")

    def test_one_node_copies_a_step_marker_last_then_verifies_it(self, durable: Tier, memory_root: str) -> None:
        memory = memory_tier(memory_root)
        save_step(memory, 3)
        sealed = sealed_step(memory, 3, NS)
        assert (sealed.metadata, sealed.manifest.save_id) == (METADATA, "s1")
        pins = pin_files(memory, 3, sorted(sealed.manifest.files))
        assert len(pins_held(memory)) == 2
        check_files(pins, sealed.manifest, memory.location(3))
        sent: list[tuple[str, int]] = []
        nbytes = put_files(durable, 3, "s1", pins, done=lambda n, name: sent.append((name, n)))
        assert nbytes == sum(len(d) for d in FILES.values())
        assert sent == [(n, len(FILES[n])) for n in sorted(FILES)]
        assert pins_held(memory) == []  # put_files released them
        assert committed(durable) == []  # the data alone is no step: the marker comes last
        commit_step(durable, 3, "s1", sealed.metadata, sealed.manifest_raw)
        assert committed(durable) == [3]
        verify_step(durable, 3, NS)
        assert durable.read_file(3, layout.METADATA) == METADATA
        for name, data in FILES.items():
            assert bytes(durable.read_range(3, name, 0, len(data))) == data
        assert sealed_manifest(durable, 3, NS).save_id == "s1"

    def test_each_node_sends_its_files_and_one_commits(self, durable: Tier, node_root: Callable[[str], str]) -> None:
        nodes = {name: memory_tier(node_root(name[2])) for name in FILES}  # node "0" holds __0_0, node "1" __1_0
        for name, memory in nodes.items():
            save_step(memory, 5, held=(name,))
        for name, memory in nodes.items():
            sealed = sealed_step(memory, 5, NS)
            mine = sorted(n for n in memory.list_steps()[-1].files if n in sealed.manifest.files)
            assert mine == [name]
            assert put_files(durable, 5, sealed.manifest.save_id, pin_files(memory, 5, mine)) == len(FILES[name])
            assert committed(durable) == []
        commit_step(durable, 5, "s1", METADATA, nodes["__0_0.distcp"].read_file(5, layout.MANIFEST))
        verify_step(durable, 5, NS)

    def test_pins_keep_the_files_when_retention_deletes_the_step(self, durable: Tier, memory_root: str) -> None:
        memory = memory_tier(memory_root)
        save_step(memory, 2)
        sealed = sealed_step(memory, 2, NS)
        pins = pin_files(memory, 2, sorted(FILES))
        memory.delete(2)
        put_files(durable, 2, "s1", pins)
        commit_step(durable, 2, "s1", sealed.metadata, sealed.manifest_raw)
        verify_step(durable, 2, NS)
        assert pins_held(memory) == []

    def test_a_file_gone_before_its_pin_sends_nothing(self, durable: Tier, memory_root: str) -> None:
        memory = memory_tier(memory_root)
        save_step(memory, 4)
        (memory.step_dir(4) / "__1_0.distcp").unlink()
        pins = pin_files(memory, 4, sorted(FILES))
        assert pins["__1_0.distcp"] is None
        with pytest.raises(CheckpointNotFoundError, match="__1_0.distcp of step 4 left the memory tier"):
            check_files(pins, sealed_step(memory, 4, NS).manifest, memory.location(4))
        assert pins_held(memory) == []
        pins = pin_files(memory, 4, sorted(FILES))
        with pytest.raises(CheckpointNotFoundError, match="__1_0.distcp of step 4 left the memory tier"):
            put_files(durable, 4, "s1", pins)
        assert durable.list_steps(include_uncommitted=True) == []  # not even the first file went
        assert pins_held(memory) == []

    def test_a_corrupt_memory_copy_fails_its_check_before_a_byte_is_sent(self, durable: Tier,
                                                                         memory_root: str) -> None:
        memory = memory_tier(memory_root)
        save_step(memory, 6)
        path = memory.step_dir(6) / "__1_0.distcp"
        raw = bytearray(path.read_bytes())
        raw[50000] ^= 0xFF
        path.write_bytes(bytes(raw))
        sealed = sealed_step(memory, 6, NS)
        pins = pin_files(memory, 6, sorted(FILES))
        with pytest.raises(IntegrityError, match=r"__1_0.distcp: item at offset 35000 \(35001 bytes\) fails"):
            check_files(pins, sealed.manifest, memory.location(6))
        assert pins_held(memory) == [] and durable.list_steps(include_uncommitted=True) == []  # released
        release_pins(pins)  # twice is no error

    def test_a_step_that_is_not_sealed_is_refused(self, memory_root: str) -> None:
        memory = memory_tier(memory_root)
        save_step(memory, 7)
        with pytest.raises(IntegrityError, match="manifest belongs to copy-run/step_7"):
            sealed_step(memory, 7, "another-run")
        (memory.step_dir(7) / layout.METADATA).write_bytes(b"not the metadata")
        with pytest.raises(IntegrityError, match=".metadata fails its checksum"):
            sealed_step(memory, 7, NS)

    def test_verify_step_reads_the_durable_copy_back(self, durable: Tier, memory_root: str) -> None:
        memory = memory_tier(memory_root)
        save_step(memory, 8)
        sealed = sealed_step(memory, 8, NS)
        put_files(durable, 8, "s1", pin_files(memory, 8, sorted(FILES)))
        wrong = bytearray(FILES["__0_0.distcp"])
        wrong[0] ^= 0xFF
        durable.put_file(8, "s1", "__0_0.distcp", bytes(wrong))  # the same size: commit takes it
        commit_step(durable, 8, "s1", sealed.metadata, sealed.manifest_raw)
        with pytest.raises(IntegrityError, match="the durable copy at .* fails verification after the copy"):
            verify_step(durable, 8, NS)
