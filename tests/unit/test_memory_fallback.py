"""A failing memory tier falls back to the durable tier (issue 19, item 6).

Real failures: a 4 MiB tmpfs that a step does not fit (ENOSPC), a read-only tmpfs (the memory
directory cannot be written). The save goes to the durable tier with one warning naming the
cause and a metric, and loads back bitwise; without a durable tier it fails, typed, as before,
and the previous step stays loadable.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt.metrics
from tierckpt import CheckpointConfig, Checkpointer, StorageError

FALLBACK_WARNING = "the memory tier failed"


def state(step: int, rows: int = 768) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(rows, 1024, generator=g), "step": torch.tensor(step)}  # rows=768: 3 MiB


def loads_bitwise(ck: Checkpointer, step: int, rows: int = 768) -> list[str]:
    out = {"w": torch.zeros(rows, 1024), "step": torch.tensor(0)}
    assert ck.load(out, step=step) == step
    want = state(step, rows)
    assert torch.equal(out["w"], want["w"]) and torch.equal(out["step"], want["step"])
    return sorted(ck.last_load["tiers"])


@pytest.fixture
def fallback_metrics() -> Any:
    m = tierckpt.metrics.enable()
    yield m
    tierckpt.metrics.disable()


def test_full_memory_tier_falls_back_to_the_durable_tier(small_tmpfs: Any, durable_dir: Path, fallback_metrics: Any,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    mem = small_tmpfs("4m")
    cfg = CheckpointConfig(namespace="fb", memory_dir=str(mem), durable_url=f"file://{durable_dir}",
                           durable_every_n_steps=0, memory_steps_retained=2)
    with Checkpointer(cfg) as ck, caplog.at_level(logging.INFO, logger="tierckpt"):
        first = ck.save(1, state(1))  # 3 MiB fits the 4 MiB tmpfs: memory
        first.result()
        assert first.fallback is None
        handles = [ck.save(s, state(s)) for s in (2, 3)]  # the newest step keeps its slot: no room for another
        ck.wait()
        assert [h.fallback for h in handles] == ["no_space", "no_space"]
        warned = [r for r in caplog.records if FALLBACK_WARNING in r.getMessage() and r.levelno == logging.WARNING]
        assert len(warned) == 1 and "no_space" in warned[0].getMessage() and "full" in warned[0].getMessage()
        assert fallback_metrics.fallbacks.value(namespace="fb", cause="no_space") == 2
        tiers = {s.step: set(s.tiers) for s in ck.steps()}
        assert tiers == {1: {"memory"}, 2: {"durable"}, 3: {"durable"}}
    with Checkpointer(cfg) as ck:  # a fresh process view: the durable steps load, verified, bitwise
        assert loads_bitwise(ck, 3) == ["durable"]
        assert loads_bitwise(ck, 1) == ["memory"]  # the previous good step is untouched


def test_unwritable_memory_dir_falls_back(small_tmpfs: Any, durable_dir: Path, fallback_metrics: Any) -> None:
    mem = small_tmpfs("4m", ro=True)
    cfg = CheckpointConfig(namespace="fbro", memory_dir=str(mem), durable_url=f"file://{durable_dir}")
    with Checkpointer(cfg) as ck:
        handle = ck.save(4, state(4, rows=64))
        handle.result()
        assert handle.fallback == "unwritable"
        assert fallback_metrics.fallbacks.value(namespace="fbro", cause="unwritable") == 1
        assert loads_bitwise(ck, 4, rows=64) == ["durable"]


def test_without_a_durable_tier_the_save_fails_typed(small_tmpfs: Any) -> None:
    mem = small_tmpfs("4m")
    cfg = CheckpointConfig(namespace="fbnone", memory_dir=str(mem), durable_url=None)
    with Checkpointer(cfg) as ck:
        ck.save(1, state(1)).result()
        with pytest.raises(StorageError, match="file system is full") as info:
            ck.save(2, state(2))
        assert info.value.tier == "memory"
        assert loads_bitwise(ck, 1) == ["memory"]


def test_a_memory_commit_that_runs_out_of_space_falls_back(small_tmpfs: Any, durable_dir: Path,
                                                           fallback_metrics: Any) -> None:
    """The slot fits the tmpfs to the last page; the step's .metadata then does not (inside DCP's save)."""
    mem = small_tmpfs("4m")
    rows = 1023  # the slot takes every page of the 4 MiB tmpfs, headers included
    cfg = CheckpointConfig(namespace="fbc", memory_dir=str(mem), durable_url=f"file://{durable_dir}",
                           durable_every_n_steps=0)
    with Checkpointer(cfg) as ck:
        handle = ck.save(7, {"w": state(7, rows)["w"]})
        handle.result()
        assert handle.fallback == "no_space"
        assert fallback_metrics.fallbacks.value(namespace="fbc", cause="no_space") == 1
        out = {"w": torch.zeros(rows, 1024)}
        assert ck.load(out, step=7) == 7 and ck.last_load["tiers"] == ["durable"]
        assert torch.equal(out["w"], state(7, rows)["w"])


# -- the DCP plug-ins ---------------------------------------------------------------------------
def _plugin_cfg(mem: Path, durable_dir: Path, ns: str) -> CheckpointConfig:
    return CheckpointConfig(namespace=ns, memory_dir=str(mem), durable_url=f"file://{durable_dir}",
                            durable_every_n_steps=0)


def _dcp_load(cfg: CheckpointConfig, step: int, rows: int) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    from tierckpt import TieredStorageReader

    out = {"w": torch.zeros(rows, 1024), "step": torch.tensor(0)}
    dcp.load(out, storage_reader=TieredStorageReader(cfg, step=step))
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_dcp_plugin_save_that_goes_durable_falls_back(small_tmpfs: Any, durable_dir: Path, fallback_metrics: Any,
                                                      mode: str) -> None:
    import torch.distributed.checkpoint as dcp

    from tierckpt import TieredStorageWriter

    mem = small_tmpfs("4m")
    cfg = _plugin_cfg(mem, durable_dir, f"fbdcp-{mode}")
    sd = state(5, rows=1536)  # 6 MiB: no slot of it fits the 4 MiB tmpfs
    writer = TieredStorageWriter(cfg, step=5, durable=True)
    if mode == "sync":
        dcp.save(sd, storage_writer=writer)
    else:
        dcp.async_save(sd, storage_writer=writer).result()
    assert fallback_metrics.fallbacks.value(namespace=cfg.namespace, cause="no_space") == 1
    assert not (mem / cfg.namespace / "step_5").exists()
    out = _dcp_load(cfg, 5, rows=1536)
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["step"], sd["step"])


def test_dcp_plugin_memory_only_save_still_fails_typed(small_tmpfs: Any, durable_dir: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from tierckpt import TieredStorageWriter

    mem = small_tmpfs("4m")
    cfg = _plugin_cfg(mem, durable_dir, "fbdcp-mem")
    with pytest.raises(CheckpointException) as info:  # no durable copy asked: nowhere to go (DCP wraps the error)
        dcp.save(state(5, rows=1536), storage_writer=TieredStorageWriter(cfg, step=5, durable=False))
    inner = next(iter(info.value.failures.values()))
    inner = inner[0] if isinstance(inner, tuple) else inner
    assert isinstance(inner, StorageError) and inner.tier == "memory" and "file system is full" in str(inner)
    assert not list(durable_dir.rglob("COMMITTED"))


def test_dcp_plugin_memory_commit_out_of_space_falls_back(small_tmpfs: Any, durable_dir: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from tierckpt import TieredStorageWriter

    mem = small_tmpfs("4m")
    cfg = _plugin_cfg(mem, durable_dir, "fbdcp-commit")
    sd = {"w": state(6, rows=1023)["w"]}  # the slot takes every page; .metadata then does not fit
    dcp.save(sd, storage_writer=TieredStorageWriter(cfg, step=6, durable=True))
    out = {"w": torch.zeros(1023, 1024)}
    import tierckpt

    with tierckpt.Checkpointer(cfg) as ck:
        assert ck.load(out, step=6) == 6 and ck.last_load["tiers"] == ["durable"]
    assert torch.equal(out["w"], sd["w"])


def test_only_memory_tier_failures_fall_back() -> None:
    import errno

    from tierckpt.dcp.fallback import memory_failure
    from tierckpt.errors import CheckpointFailedError, DurableWriteError, MemoryBudgetError

    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = CheckpointFailedError("checkpoint of step 1 failed")
    wrapped.__cause__ = OSError(errno.EROFS, "Read-only file system")
    durable = DurableWriteError("durable put failed", tier="durable")
    durable.__cause__ = full
    assert memory_failure(StorageError("slot", tier="memory")) == "error"
    assert memory_failure(full) == "no_space" and memory_failure(wrapped) == "unwritable"
    assert memory_failure(durable) is None  # the durable tier's disk being full is not a memory failure
    assert memory_failure(MemoryBudgetError("over the budget", tier="memory")) is None
    assert memory_failure(ValueError("bad")) is None


def test_overlapped_save_falls_back_too(small_tmpfs: Any, durable_dir: Path) -> None:
    mem = small_tmpfs("4m", ro=True)
    cfg = CheckpointConfig(namespace="fbov", memory_dir=str(mem), durable_url=f"file://{durable_dir}")
    with Checkpointer(cfg) as ck:
        sd = state(8, rows=64)
        handle = ck.save(8, sd, overlap=True)
        handle.wait_staged()
        sd["w"].add_(1.0)  # the caller's tensors may change once staged: the checkpoint keeps the old values
        handle.result()
        assert handle.fallback == "unwritable"
        assert loads_bitwise(ck, 8, rows=64) == ["durable"]
