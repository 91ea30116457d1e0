"""After a non-finite loss: saves are held back and the restart resumes from an older step.

Issue 15, item 2: a NaN that reached the weights was reloaded forever, because each restart
resumed the newest step, saved after the loss went non-finite. Here, on 2 real gloo ranks:
- ``TIERCKPT_RESUME_BEFORE=N`` (what ``tierckpt run`` sets after a non-finite loss at step N)
  makes ``Checkpointer.load`` load the newest step older than N on every rank, agreed across
  ranks, global and local mode, bitwise;
- a save made after a non-finite ``monitor.step`` is committed nowhere (``handle.skipped`` says
  why), until a finite loss is reported; and a save whose commit is still in the background
  when the non-finite loss of its step arrives is not committed either.
"""

from __future__ import annotations

import os
import time

import pytest

import tierckpt
from tests.helpers.dist import run_ranks
from tests.helpers.state import assert_state_equal, from_wire, small_state, to_wire, zeros_like_state

NS = "nonfinite"

pytestmark = pytest.mark.slow


def _save_steps(rank: int, roots: list[str], local_mode: bool) -> list[int]:
    cfg = tierckpt.CheckpointConfig(namespace=NS, memory_dir=roots[rank], local_mode=local_mode,
                                    memory_steps_retained=5)
    with tierckpt.Checkpointer(cfg) as ck:
        for step in (1, 2, 3, 4, 5):
            ck.save(step, small_state(step, rank))
        ck.wait()
        return [i.step for i in ck.steps()]


def _load_under_launcher(rank: int, roots: list[str], local_mode: bool, bounds: list[str | None]) -> dict:
    bound = bounds[rank]
    if bound is not None:  # what tierckpt run exports to the workers after a non-finite loss
        os.environ["TIERCKPT_RESUME_BEFORE"] = bound
    cfg = tierckpt.CheckpointConfig(namespace=NS, memory_dir=roots[rank], local_mode=local_mode)
    sd = zeros_like_state(small_state(0, rank))
    with tierckpt.Checkpointer(cfg) as ck:
        step = ck.load(sd)
        explicit = ck.load(zeros_like_state(small_state(0, rank)), step=5)  # an explicit step is not bounded
        # training goes on: once this job saved again, a load sees its newest step, bound or not
        ck.save(6, small_state(6, rank)).wait()
        after_save = ck.load(zeros_like_state(small_state(0, rank)))
    return {"step": step, "explicit": explicit, "bound": cfg.resume_before, "state": to_wire(sd),
            "after_save": after_save}


@pytest.mark.parametrize("local_mode", [False, True], ids=["global", "local"])
def test_resume_before_loads_the_newest_older_step_on_every_rank(shm, local_mode: bool) -> None:
    # global mode: one node (each rank needs the replicated tensors rank 0 saved); local: one root each
    roots = [shm("nodeA"), shm("nodeB")] if local_mode else [shm("node")] * 2
    assert run_ranks(_save_steps, 2, roots, local_mode, timeout=120) == [[1, 2, 3, 4, 5]] * 2
    # rank 1's bound is lower (its loss went non-finite first): both ranks agree on step 2
    outs = run_ranks(_load_under_launcher, 2, roots, local_mode, ["4", "3"], timeout=120)
    for rank, out in enumerate(outs):
        assert (out["step"], out["explicit"], out["bound"], out["after_save"]) == (2, 5, [4, 3][rank], 6), out
        assert_state_equal(from_wire(out["state"]), small_state(2, rank))
    # no step older than the bound: a fresh start (None), with a warning, not a newer step
    outs = run_ranks(_load_under_launcher, 2, roots, local_mode, ["1", "1"], timeout=120)
    assert [o["step"] for o in outs] == [None, None]
    assert [o["after_save"] for o in outs] == [6, 6]


def _nan_then_save(rank: int, root: str, nan_rank: int) -> dict:
    import math

    import tierckpt.monitor as monitor

    cfg = tierckpt.CheckpointConfig(namespace=NS, memory_dir=root, memory_steps_retained=5)
    out: dict = {}
    with tierckpt.Checkpointer(cfg) as ck:
        monitor.step(1, loss=0.5)
        assert ck.save(1, small_state(1, rank)).wait() is None
        # order 1: the non-finite loss is reported first (on one rank only), then the save
        monitor.step(2, loss=math.nan if rank == nan_rank else 0.5)
        h2 = ck.save(2, small_state(2, rank))
        h2.wait()
        out["skipped_2"] = h2.skipped
        monitor.step(3, loss=math.inf if rank == nan_rank else 0.5)  # still non-finite
        h3 = ck.save(3, small_state(3, rank))
        h3.wait()
        out["skipped_3"] = h3.skipped
        monitor.step(4, loss=0.25)  # finite again: saves commit again
        h4 = ck.save(4, small_state(4, rank))
        h4.wait()
        out["skipped_4"] = h4.skipped
        # order 2: the save of step 5, then its non-finite loss while the commit is still in the
        # background (the other rank joins the commit's collectives 2 s later)
        if rank != nan_rank:
            time.sleep(2.0)
        h5 = ck.save(5, small_state(5, rank))
        if rank == nan_rank:
            monitor.step(5, loss=math.nan)
        h5.wait()
        out["skipped_5"] = h5.skipped
        ck.wait()  # a held-back save is no failure
        out["steps"] = [i.step for i in ck.steps()]
        sd = zeros_like_state(small_state(0, rank))
        out["loaded"] = ck.load(sd)
        out["state"] = to_wire(sd)
    return out


def test_saves_after_a_non_finite_loss_are_not_committed(shm) -> None:
    root = shm("node")
    outs = run_ranks(_nan_then_save, 2, root, 1, timeout=150)
    for rank, out in enumerate(outs):
        assert out["steps"] == [1, 4], out  # 2, 3 and 5 were committed nowhere
        assert out["skipped_2"] and out["skipped_3"] and out["skipped_5"], out
        assert out["skipped_4"] is None, out
        assert out["loaded"] == 4
        assert_state_equal(from_wire(out["state"]), small_state(4, rank))
    nan_rank = outs[1]
    assert "non-finite at step 2" in nan_rank["skipped_2"], nan_rank
    assert "non-finite loss at step 5" in nan_rank["skipped_5"], nan_rank
