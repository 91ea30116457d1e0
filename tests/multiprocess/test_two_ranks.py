"""Two real gloo ranks on one node (one memory root): save, then fresh processes load.

Proves that a step written by one set of processes is found, agreed on and loaded bitwise
by a new set, from shared memory alone, through both the Checkpointer and the DCP plug-ins.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

import tierckpt
from tests.helpers.dist import run_ranks
from tests.helpers.state import assert_state_equal, from_wire, small_state, to_wire, zeros_like_state

NS = "two-ranks"

pytestmark = pytest.mark.slow


def _config(memory_dir: str, durable_url: str | None = None, **kw) -> tierckpt.CheckpointConfig:
    return tierckpt.CheckpointConfig(namespace=NS, memory_dir=memory_dir, durable_url=durable_url, **kw)


def _save_checkpointer(rank: int, memory_dir: str, steps: list[int]) -> list[int]:
    with tierckpt.Checkpointer(_config(memory_dir, memory_steps_retained=2)) as ck:
        assert ck.load(zeros_like_state(small_state(0, rank))) is None  # nothing there yet
        handles = [ck.save(step, small_state(step, rank)) for step in steps]
        ck.wait()
        assert all(h.done() and h.exception() is None for h in handles)
        return [info.step for info in ck.steps()]


def _load_checkpointer(rank: int, memory_dir: str, step: int | None) -> dict:
    sd = zeros_like_state(small_state(0, rank))
    with tierckpt.Checkpointer(_config(memory_dir)) as ck:
        got = ck.load(sd, step=step)
        out = {"step": got, "tiers": ck.last_load["tiers"], "state": to_wire(sd)}
        try:
            ck.load(zeros_like_state(sd), step=1)  # evicted by retention
        except tierckpt.CheckpointNotFoundError as exc:
            out["evicted"] = type(exc).__name__
        return out


def test_checkpointer_two_ranks_resume_from_memory(shm):
    mem = shm()
    listed = run_ranks(_save_checkpointer, 2, mem, [1, 2, 3, 4])
    assert listed == [[3, 4], [3, 4]]  # memory_steps_retained=2 on both ranks
    for want in (None, 3):
        loaded = run_ranks(_load_checkpointer, 2, mem, want)
        for rank, out in enumerate(loaded):
            expect_step = 4 if want is None else 3
            assert out["step"] == expect_step
            assert out["tiers"] == ["memory"]
            assert out["evicted"] == "CheckpointNotFoundError"
            assert_state_equal(from_wire(out["state"]), small_state(expect_step, rank))


def _save_dcp(rank: int, memory_dir: str, steps: list[int]) -> None:
    cfg = _config(memory_dir, memory_steps_retained=3)
    for step in steps[:-1]:
        dcp.save(small_state(step, rank), storage_writer=tierckpt.TieredStorageWriter(cfg, step=step))
    last = steps[-1]
    fut = dcp.async_save(small_state(last, rank), storage_writer=tierckpt.TieredStorageWriter(cfg, path=f"run/step_{last}"))
    fut.result(timeout=60)


def _load_dcp(rank: int, memory_dir: str, step: int | None) -> dict:
    sd = zeros_like_state(small_state(0, rank))
    reader = tierckpt.TieredStorageReader(_config(memory_dir), step=step)
    dcp.load(sd, storage_reader=reader)
    return {"step": reader.step, "tiers": sorted(set(reader.tiers_used.values())), "state": to_wire(sd)}


def test_dcp_plugins_two_ranks_resume_from_memory(shm):
    mem = shm()
    run_ranks(_save_dcp, 2, mem, [5, 6, 7])
    # each rank stages into its own slots (.slots/rank_<r>), never into another rank's
    assert sorted(p.name for p in (Path(mem) / NS / ".slots").iterdir()) == ["rank_0", "rank_1"]
    for want, expect_step in ((None, 7), (5, 5)):
        loaded = run_ranks(_load_dcp, 2, mem, want)
        for rank, out in enumerate(loaded):
            assert out["step"] == expect_step
            assert out["tiers"] == ["memory"]
            assert_state_equal(from_wire(out["state"]), small_state(expect_step, rank))


def _save_overlapped(rank: int, memory_dir: str, steps: list[int]) -> list[int]:
    """Each step: set the state to small_state(step), save overlapped, then let SGD change it."""
    import torch

    sd = small_state(steps[0], rank)
    params = [sd["model"]["w"], sd[f"rank{rank}"]["opt"]]
    for p in params:
        p.requires_grad_(True)
        p.grad = torch.ones_like(p)
    opt = torch.optim.SGD(params, lr=1.0)
    with tierckpt.Checkpointer(_config(memory_dir, memory_steps_retained=2)) as ck:
        ck.register_fence(opt)
        for step in steps:
            with torch.no_grad():
                want = small_state(step, rank)
                for p, src in zip(params, (want["model"]["w"], want[f"rank{rank}"]["opt"]), strict=True):
                    p.copy_(src)
                sd["model"]["b"].copy_(want["model"]["b"])
                sd[f"rank{rank}"]["ids"].copy_(want[f"rank{rank}"]["ids"])
            sd["step"] = step
            handle = ck.save(step, sd, overlap=True, check_snapshot=True)
            opt.step()  # fenced: waits for the copy, then changes w and opt in place
            handle.wait_staged()
            sd[f"rank{rank}"]["ids"].add_(1)  # after wait_staged: not in the checkpoint either
        ck.wait()
        return [info.step for info in ck.steps()]


def test_overlapped_saves_two_ranks_load_the_values_at_the_call(shm):
    mem = shm()
    assert run_ranks(_save_overlapped, 2, mem, [1, 2, 3]) == [[2, 3], [2, 3]]
    for want in (None, 2):
        loaded = run_ranks(_load_checkpointer, 2, mem, want)
        for rank, out in enumerate(loaded):
            expect_step = 3 if want is None else 2
            assert out["step"] == expect_step and out["tiers"] == ["memory"]
            assert_state_equal(from_wire(out["state"]), small_state(expect_step, rank))
