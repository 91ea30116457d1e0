"""Loading, one process, real tiers on /dev/shm and a local disk: checks while reading, strictness,
byte ranges, and safe unpickling of a checkpoint's objects."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tierckpt import CheckpointConfig, Checkpointer, TieredStorageReader, UnsafeObjectError
from tierckpt.errors import IntegrityError, LoadMismatchWarning, StateDictMismatchError
from tierckpt.tiers.integrity import MappedReader
from tierckpt.tiers.local import LocalFileReader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state(v: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(v)
    return {
        "w": torch.randn(256, 512, generator=g),  # 512 KiB
        "b": torch.randn(1000, generator=g).to(torch.bfloat16),
        "n": torch.randint(0, 1 << 40, (77,), generator=g),
        "extra": {"epoch": v, "lr": 0.5 / (v + 1), "rng": torch.get_rng_state()},
    }


def blank() -> dict[str, Any]:
    return {"w": torch.zeros(256, 512), "b": torch.zeros(1000, dtype=torch.bfloat16),
            "n": torch.zeros(77, dtype=torch.int64),
            "extra": {"epoch": -1, "lr": 0.0, "rng": torch.zeros_like(torch.get_rng_state())}}


def same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k in ("w", "b", "n"):  # bitwise
        assert got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k
    assert got["extra"]["epoch"] == want["extra"]["epoch"] and got["extra"]["lr"] == want["extra"]["lr"]
    assert torch.equal(got["extra"]["rng"], want["extra"]["rng"])


@pytest.fixture
def cfg(shm_root: Path, durable_dir: Path) -> CheckpointConfig:
    return CheckpointConfig(namespace="load", memory_dir=str(shm_root), durable_url=f"file://{durable_dir}",
                            memory_steps_retained=2)


def flip_tensor_byte(step_dir: Path, name: str = "__0_0.distcp") -> None:
    """Flip a byte inside the first tensor's raw bytes of ``name``."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    _, offset, _, data_offset, _ = next(i for i in manifest["items"] if i[0] == name and i[3] >= 0)
    with open(step_dir / name, "r+b") as f:
        f.seek(offset + data_offset + 5)
        byte = f.read(1)
        f.seek(offset + data_offset + 5)
        f.write(bytes([byte[0] ^ 0x10]))


# -- the checksum check while reading ------------------------------------------------------------
class _FlipBeforeRead(TieredStorageReader):
    """Damages the memory copy after the pre-read check passed: only the check while reading sees it."""

    def __init__(self, *args: Any, step_dir: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_dir = step_dir

    def read_data(self, plan: Any, planner: Any) -> Any:
        flip_tensor_byte(self.step_dir)
        return super().read_data(plan, planner)


def test_damage_after_the_pre_check_is_caught_while_reading_and_read_from_durable(cfg: CheckpointConfig, shm_root: Path) -> None:
    with Checkpointer(cfg) as ck:
        ck.save(1, state(1))
        ck.wait()
    reader = _FlipBeforeRead(cfg, step_dir=shm_root / "load" / "step_1")  # verify_ahead=True: pre-check passes
    out = blank()
    dcp.load(out, storage_reader=reader)
    assert reader.tiers_used["__0_0.distcp"] == "durable"
    same(out, state(1))


def test_damage_after_the_pre_check_without_another_copy_is_an_integrity_error(shm_root: Path) -> None:
    cfg = CheckpointConfig(namespace="load", memory_dir=str(shm_root))
    with Checkpointer(cfg) as ck:
        ck.save(1, state(1))
        ck.wait()
    reader = _FlipBeforeRead(cfg, step_dir=shm_root / "load" / "step_1")
    with pytest.raises(CheckpointException):
        dcp.load(blank(), storage_reader=reader)
    assert isinstance(reader.failure, IntegrityError) and "fails its checksum" in str(reader.failure)


def test_checkpointer_checks_while_reading_and_falls_back_to_the_older_step(shm_root: Path) -> None:
    cfg = CheckpointConfig(namespace="load", memory_dir=str(shm_root))
    with Checkpointer(cfg) as ck:
        ck.save(1, state(1))
        ck.save(2, state(2))
        ck.wait()
        flip_tensor_byte(shm_root / "load" / "step_2")
        out = blank()
        assert ck.load(out) == 1
        assert [s for s, _ in ck.last_load["skipped"]] == [2]
        same(out, state(1))


def test_every_step_damaged_is_an_integrity_error_naming_them_not_a_fresh_start(shm_root: Path) -> None:
    cfg = CheckpointConfig(namespace="load", memory_dir=str(shm_root))
    with Checkpointer(cfg) as ck:
        ck.save(1, state(1))
        ck.save(2, state(2))
        ck.wait()
        for step in (1, 2):
            flip_tensor_byte(shm_root / "load" / f"step_{step}")
        with pytest.raises(IntegrityError, match=r"no step loads: step 2: .*checksum.*; step 1: .*checksum"):
            ck.load(blank())


READERS = {"file": LocalFileReader, "mapped": MappedReader}


@pytest.mark.parametrize("path", ["file", "mapped"])
def test_a_record_is_read_straight_into_its_tensor_once(cfg: CheckpointConfig, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Spies on the real reads (they still happen): the tensor's bytes land in the target's memory.

    ``mapped``: the process that saved the step loads it (its slot is mapped already);
    ``file``: another Checkpointer (a restarted process's view) reads the file with pread.
    """
    with Checkpointer(cfg) as saver:
        saver.save(1, state(1))
        saver.wait()
        loader = saver if path == "mapped" else Checkpointer(cfg)
        out = blank()
        targets = {t.data_ptr(): k for k, t in out.items() if isinstance(t, torch.Tensor)}
        landed: list[tuple[str, str]] = []
        read_bytes = [0]

        def spying(kind: str, real: Any) -> Any:
            def spy(self: Any, offset: int, buf: memoryview, hasher: Any = None) -> None:
                addr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr() if len(buf) else 0
                if addr in targets:
                    landed.append((targets[addr], kind))
                read_bytes[0] += len(buf)
                real(self, offset, buf, hasher)
            return spy

        for kind, cls in READERS.items():  # the objects' file is not a slot: it is read from the file
            monkeypatch.setattr(cls, "read_into", spying(kind, cls.read_into))
        assert loader.load(out) == 1
        if loader is not saver:
            loader.close()
        same(out, state(1))
        assert sorted(landed) == [("b", path), ("n", path), ("w", path)]
        manifest = json.loads((Path(cfg.memory_dir) / "load" / "step_1" / "manifest.json").read_text())
        assert read_bytes[0] == sum(i[2] for i in manifest["items"])  # every record once, nothing else


@pytest.mark.parametrize("path", ["file", "mapped"])
def test_a_partial_load_reads_only_the_records_it_needs(cfg: CheckpointConfig, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    with Checkpointer(cfg) as saver:
        saver.save(1, state(1))
        saver.wait()
        loader = saver if path == "mapped" else Checkpointer(cfg)
        spans: list[tuple[int, int]] = []

        def spying(real: Any) -> Any:
            def spy(self: Any, offset: int, buf: memoryview, hasher: Any = None) -> None:
                spans.append((offset, len(buf)))
                real(self, offset, buf, hasher)
            return spy

        for cls in READERS.values():
            monkeypatch.setattr(cls, "read_into", spying(cls.read_into))
        out = {"n": torch.zeros(77, dtype=torch.int64)}
        with pytest.warns(LoadMismatchWarning, match=r"5 checkpoint key\(s\) the state dict does not load: b, extra.epoch, extra.lr, extra.rng, w \("):
            assert loader.load(out) == 1
        if loader is not saver:
            loader.close()
        assert torch.equal(out["n"], state(1)["n"])
    manifest = json.loads((Path(cfg.memory_dir) / "load" / "step_1" / "manifest.json").read_text())
    size = manifest["files"]["__0_0.distcp"]
    total = sum(n for _, n in spans)
    assert 77 * 8 <= total < 4096 < size  # the record of "n", not the file


# -- dtype casts and unloaded keys ---------------------------------------------------------------
def test_a_cast_warns_naming_the_key_and_strict_refuses_it(cfg: CheckpointConfig) -> None:
    with Checkpointer(cfg) as ck:
        ck.save(1, state(1))
        ck.wait()
        out = blank()
        out["b"] = torch.zeros(1000, dtype=torch.float32)
        with pytest.warns(LoadMismatchWarning, match=r"cast to the state dict's dtype: b \(bfloat16 -> float32\)"):
            assert ck.load(out) == 1
        assert torch.equal(out["b"], state(1)["b"].float())  # DCP's behaviour: cast
        out = blank()
        out["b"] = torch.zeros(1000, dtype=torch.float32)
        with pytest.raises(StateDictMismatchError, match=r"strict=True.*b \(bfloat16 -> float32\)"):
            ck.load(out, strict=True)
        with pytest.raises(StateDictMismatchError, match=r"does not load: extra.epoch"):
            ck.load({"w": torch.zeros(256, 512), "b": torch.zeros(1000, dtype=torch.bfloat16),
                     "n": torch.zeros(77, dtype=torch.int64)}, strict=True)
        out = blank()
        assert ck.load(out, strict=True) == 1  # an exact match is fine under strict
        same(out, state(1))


def test_reader_strict_refuses_a_cast_under_plain_dcp(cfg: CheckpointConfig) -> None:
    with Checkpointer(cfg) as ck:
        ck.save(1, state(1))
        ck.wait()
    out = blank()
    out["w"] = torch.zeros(256, 512, dtype=torch.float64)
    reader = TieredStorageReader(cfg, strict=True)
    with pytest.raises(CheckpointException):
        dcp.load(out, storage_reader=reader)
    assert isinstance(reader.failure, StateDictMismatchError) and "w (float32 -> float64)" in str(reader.failure)
    assert not out["w"].any()  # refused before any byte was read


# -- safe objects --------------------------------------------------------------------------------
class Evil:
    """Unpickling this runs a shell command that creates a file (the save's snapshot keeps it as is)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __deepcopy__(self, memo: dict[int, Any]) -> Evil:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class Harmless:
    def __init__(self, value: int) -> None:
        self.value = value


def evil_state(marker: Path) -> dict[str, Any]:
    return {"w": torch.ones(4), "extra": {"payload": Evil(marker)}}


@pytest.mark.parametrize("tier", ["memory", "durable"])
def test_a_malicious_object_is_refused_from_every_local_tier(cfg: CheckpointConfig, shm_root: Path, tmp_path: Path, tier: str) -> None:
    marker = tmp_path / "pwned"
    with Checkpointer(cfg) as ck:
        ck.save(1, evil_state(marker), durable=True)
        ck.wait()
    if tier == "durable":
        import shutil

        shutil.rmtree(shm_root / "load")
    with Checkpointer(cfg) as ck:
        out = {"w": torch.zeros(4), "extra": {"payload": None}}
        with pytest.raises(UnsafeObjectError, match=r"'extra.payload' references posix.system.*trusted=True") as info:
            ck.load(out)
        assert info.value.names == ("posix.system",) and info.value.step == 1
        assert ck.last_load is None or ck.last_load.get("step") != 1
    assert not marker.exists()
    reader = TieredStorageReader(cfg)  # plain dcp.load: the same allow-list
    with pytest.raises(CheckpointException):
        dcp.load({"w": torch.zeros(4), "extra": {"payload": None}}, storage_reader=reader)
    assert isinstance(reader.failure, UnsafeObjectError)
    assert not marker.exists()


def test_trusted_and_allowed_classes_are_the_opt_ins(cfg: CheckpointConfig, tmp_path: Path) -> None:
    with Checkpointer(cfg) as ck:
        ck.save(1, {"w": torch.ones(4), "h": Harmless(7)})
        ck.wait()
        with pytest.raises(UnsafeObjectError, match=r"Harmless"):
            ck.load({"w": torch.zeros(4), "h": None})
        out: dict[str, Any] = {"w": torch.zeros(4), "h": None}
        assert ck.load(out, trusted=True) == 1 and out["h"].value == 7
    with Checkpointer(cfg.replace(allowed_classes=(Harmless,))) as ck:
        out = {"w": torch.zeros(4), "h": None}
        assert ck.load(out) == 1 and out["h"].value == 7
    marker = tmp_path / "trusted-runs-it"
    with Checkpointer(cfg.replace(namespace="evil", trusted=True)) as ck:
        ck.save(1, evil_state(marker))
        ck.wait()
        ck.load({"w": torch.zeros(4), "extra": {"payload": None}})
    assert marker.exists()  # the opt-in is real: trusted unpickles in full (the test above is not vacuous)


def test_read_data_before_a_step_is_chosen_is_a_typed_error(cfg: CheckpointConfig) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import LoadPlan

    from tierckpt.errors import ProtocolError

    reader = TieredStorageReader(cfg, step=1)
    with pytest.raises(ProtocolError, match="before read_metadata"):  # not an assert: it holds under python -O
        reader.read_data(LoadPlan([]), DefaultLoadPlanner())
    assert isinstance(reader.failure, ProtocolError)
