"""Checkpointer in one process, on a real tmpfs memory tier and a real durable directory."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt import (
    CheckpointConfig,
    Checkpointer,
    CheckpointNotFoundError,
    ConfigError,
    DurableWriteError,
    IntegrityError,
    MemoryBudgetError,
    StateDictMismatchError,
)


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).to(torch.bfloat16)},
        "optim": {"step": torch.tensor(float(step)), "lr": 0.1 * step},
        "epoch": step // 10,
    }


def blank() -> dict:
    return {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16)},
            "optim": {"step": torch.tensor(0.0), "lr": 0.0}, "epoch": -1}


def assert_same(a: dict, b: dict) -> None:
    assert torch.equal(a["model"]["w"], b["model"]["w"]) and torch.equal(a["model"]["b"], b["model"]["b"])
    assert torch.equal(a["optim"]["step"], b["optim"]["step"])
    assert a["optim"]["lr"] == b["optim"]["lr"] and a["epoch"] == b["epoch"]


@pytest.fixture
def cfg(shm_root: Path, durable_dir: Path) -> CheckpointConfig:
    return CheckpointConfig(namespace="unit", memory_dir=str(shm_root), durable_url=f"file://{durable_dir}",
                            durable_every_n_steps=3)


def flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    # write through a new inode so the memory tier's slot (a hard link) is not the file changed
    tmp = path.with_name(path.name + ".flip")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)


def test_round_trip_and_steps(cfg: CheckpointConfig) -> None:
    with Checkpointer(cfg) as ck:
        assert ck.load(blank()) is None
        for s in range(1, 7):
            ck.save(s, state(s))
        ck.wait()
        infos = {i.step: i.tiers for i in ck.steps()}
        assert infos == {3: {"durable"}, 5: {"memory"}, 6: {"memory", "durable"}}
        out = blank()
        assert ck.load(out) == 6
        assert_same(out, state(6))
        assert ck.last_load["tiers"] == ["memory"]
        out = blank()
        assert ck.load(out, step=3) == 3
        assert_same(out, state(3))
        assert ck.last_load["tiers"] == ["durable"]


def test_slots_are_reused(cfg: CheckpointConfig, shm_root: Path) -> None:
    with Checkpointer(cfg.replace(durable_url=None)) as ck:
        for s in range(12):
            ck.save(s, state(s))
        ck.wait()
        slots = list((shm_root / "unit" / ".slots" / "rank_0").iterdir())
        assert len(slots) == cfg.memory_steps_retained + 1
        assert sorted(i.step for i in ck.steps()) == [10, 11]


def test_snapshot_survives_mutation_after_save(cfg: CheckpointConfig) -> None:
    sd = state(1)
    expected = {"model": {k: v.clone() for k, v in sd["model"].items()}, "optim": dict(sd["optim"]), "epoch": sd["epoch"]}
    with Checkpointer(cfg) as ck:
        ck.save(1, sd)
        sd["model"]["w"].fill_(7.0)
        del sd
        out = blank()
        ck.load(out)
        assert_same(out, expected)


def test_survives_the_death_of_the_writer(cfg: CheckpointConfig) -> None:
    code = f"""
import torch, tierckpt, os
cfg = tierckpt.CheckpointConfig(namespace="unit", memory_dir={cfg.memory_dir!r})
ck = tierckpt.Checkpointer(cfg)
ck.save(42, {{"w": torch.arange(1000, dtype=torch.float32)}}).memory_committed()
os._exit(0)  # no clean-up at all
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    out = {"w": torch.zeros(1000)}
    with Checkpointer(cfg.replace(durable_url=None)) as ck:
        assert ck.load(out) == 42
    assert torch.equal(out["w"], torch.arange(1000, dtype=torch.float32))


def test_bad_inputs(cfg: CheckpointConfig) -> None:
    with Checkpointer(cfg) as ck:
        with pytest.raises(ConfigError, match="step"):
            ck.save(-1, state(1))
        with pytest.raises(ConfigError, match="step"):
            ck.load(blank(), step=-3)
        ck.save(2, state(2))
        with pytest.raises(CheckpointNotFoundError, match="step 99"):
            ck.load(blank(), step=99)
        wrong_shape = blank()
        wrong_shape["model"]["w"] = torch.zeros(3, 3)
        with pytest.raises(StateDictMismatchError, match="model.w"):
            ck.load(wrong_shape)
        extra = blank()
        extra["model"]["new_layer"] = torch.zeros(2)
        with pytest.raises(StateDictMismatchError, match="missing from the checkpoint"):
            ck.load(extra)
        out = blank()
        assert ck.load(out) == 2  # nothing was lost
        assert_same(out, state(2))
    with Checkpointer(cfg.replace(durable_url=None)) as ck:
        with pytest.raises(ConfigError, match="durable_url"):
            ck.save(3, state(3), durable=True)


def test_memory_budget(cfg: CheckpointConfig) -> None:
    size = 64 * 32 * 4 + 32 * 2 + 4
    with Checkpointer(cfg.replace(memory_budget_bytes=size // 2, durable_url=None)) as ck:
        with pytest.raises(MemoryBudgetError, match=r"needs .* memory_budget_bytes is"):
            ck.save(1, state(1))
    with Checkpointer(cfg.replace(memory_budget_bytes=3 * 20_000, memory_steps_retained=5, durable_url=None)) as ck:
        for s in range(6):  # the budget holds fewer steps than retention asks for: oldest evicted
            ck.save(s, state(s))
        ck.wait()
        steps = [i.step for i in ck.steps()]
        assert steps[-1] == 5 and len(steps) < 5
        out = blank()
        assert ck.load(out) == 5
        assert_same(out, state(5))


def test_durable_failure_keeps_memory(cfg: CheckpointConfig, durable_dir: Path) -> None:
    (durable_dir / "unit").write_text("a file where the namespace directory should be")
    with Checkpointer(cfg) as ck:
        handle = ck.save(3, state(3))
        with pytest.raises(DurableWriteError, match="memory copy is intact"):
            handle.result(timeout=60)
        out = blank()
        assert ck.load(out) == 3
        assert_same(out, state(3))
        with pytest.raises(DurableWriteError):
            ck.save(6, state(6)).result(timeout=60)
        with pytest.raises(DurableWriteError):
            ck.wait()  # the error is kept until someone looks at it; the handles are cleared
        ck.wait()


def test_flipped_memory_byte_falls_back_to_durable(cfg: CheckpointConfig, shm_root: Path, caplog) -> None:
    with Checkpointer(cfg) as ck:
        ck.save(3, state(3))
        ck.wait()
        flip_byte(shm_root / "unit" / "step_3" / "__0_0.distcp", 1000)
        out = blank()
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            assert ck.load(out) == 3
        assert_same(out, state(3))
        assert "durable" in ck.last_load["tiers"]  # the damaged file came from durable


def test_latest_falls_back_to_older_step(cfg: CheckpointConfig, shm_root: Path, caplog) -> None:
    with Checkpointer(cfg.replace(durable_url=None)) as ck:
        ck.save(1, state(1))
        ck.save(2, state(2)).memory_committed()
        flip_byte(shm_root / "unit" / "step_2" / "__0_0.distcp", 500)
        out = blank()
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            assert ck.load(out) == 1
        assert_same(out, state(1))
        assert "step 2" in caplog.text or "Step 2" in caplog.text
        with pytest.raises(IntegrityError, match="step 2"):
            ck.load(blank(), step=2)


@pytest.mark.parametrize("victim", [".metadata", "manifest.json", "COMMITTED"])
def test_damaged_small_files(cfg: CheckpointConfig, shm_root: Path, victim: str) -> None:
    with Checkpointer(cfg.replace(durable_url=None)) as ck:
        ck.save(1, state(1))
        ck.save(2, state(2)).memory_committed()
        flip_byte(shm_root / "unit" / "step_2" / victim, 5)
        out = blank()
        assert ck.load(out) == 1
        assert_same(out, state(1))


def test_logs_in_the_seed_format(cfg: CheckpointConfig, caplog) -> None:
    user = logging.getLogger("my.training")
    with caplog.at_level(logging.INFO):
        with Checkpointer(cfg.replace(logger=user)) as ck:
            ck.save(3, state(3))
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("[Rank 0] Step 3: In-memory write completed in") and "MB/s" in m for m in lines)
    assert any(r.name == "my.training" for r in caplog.records)


def test_save_blocks_only_for_the_copy_and_commits_in_the_background(cfg: CheckpointConfig, shm_root: Path) -> None:
    import threading

    with Checkpointer(cfg.replace(durable_url=None)) as ck:
        gate = threading.Event()
        ck._save._committer.submit(gate.wait)  # hold the committer thread: save must not need it
        sd = state(1)
        handle = ck.save(1, sd)
        assert handle.staged and handle.blocking_s > 0  # the copy is done when save returns ...
        assert not handle.done() and not (shm_root / "unit" / "step_1").exists()  # ... the commit is not
        sd["model"]["w"].zero_()  # allowed: the copy is taken
        gate.set()
        handle.memory_committed(timeout=60)
        assert (shm_root / "unit" / "step_1" / "COMMITTED").exists()
        assert handle.done()
        out = blank()
        assert ck.load(out) == 1
    assert_same(out, state(1))


def test_dtensor_free_nested_lists_and_stateful(cfg: CheckpointConfig) -> None:
    class App:
        def __init__(self, v: float) -> None:
            self.t = torch.full((4,), v)

        def state_dict(self) -> dict:
            return {"t": self.t}

        def load_state_dict(self, sd: dict) -> None:
            self.t.copy_(sd["t"])

    sd = {"app": App(3.0), "layers": [torch.arange(3), {"k": torch.ones(2, 2)}], "pair": (1, "x")}
    with Checkpointer(cfg.replace(durable_url=None)) as ck:
        ck.save(1, sd)
        out = {"app": App(0.0), "layers": [torch.zeros(3, dtype=torch.int64), {"k": torch.zeros(2, 2)}], "pair": None}
        assert ck.load(out) == 1
    assert torch.equal(out["app"].t, torch.full((4,), 3.0)) and torch.equal(out["layers"][0], torch.arange(3))
    assert torch.equal(out["layers"][1]["k"], torch.ones(2, 2)) and out["pair"] == (1, "x")


def test_closed_checkpointer_refuses(cfg: CheckpointConfig) -> None:
    ck = Checkpointer(cfg)
    ck.close()
    with pytest.raises(tierckpt.TierckptError, match="closed"):
        ck.save(1, state(1))


def test_local_mode_one_process(cfg: CheckpointConfig, shm_root: Path, durable_dir: Path) -> None:
    local = cfg.replace(local_mode=True)
    with Checkpointer(local) as ck:
        assert ck.load(blank()) is None
        for s in (1, 2, 3):
            ck.save(s, state(s))
        ck.wait()
        out = blank()
        assert ck.load(out) == 3
        assert_same(out, state(3))
    assert (shm_root / "unit--rank0" / "step_3" / "COMMITTED").exists()
    assert (durable_dir / "unit--rank0" / "step_3" / "COMMITTED").exists()  # durable_every_n_steps=3
    with pytest.raises(ConfigError, match="128"):
        CheckpointConfig(namespace="x" * 125, local_mode=True).rank_local(0)


def test_close_gives_free_slots_back(cfg: CheckpointConfig, shm_root: Path) -> None:
    with Checkpointer(cfg.replace(durable_url=None, memory_steps_retained=1)) as ck:
        for s in range(4):
            ck.save(s, state(s))
        ck.wait()
        slots = shm_root / "unit" / ".slots" / "rank_0"
        assert len(list(slots.iterdir())) == 2
    assert [p.stat().st_nlink for p in slots.iterdir()] == [2]  # only the retained step's slot stays
    out = blank()
    with Checkpointer(cfg.replace(durable_url=None)) as ck:
        assert ck.load(out) == 3
    assert_same(out, state(3))
