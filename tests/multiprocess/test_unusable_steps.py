"""A load that finds committed steps but none every rank can use raises; it never returns None.

Issue 15, item 1: after a lost node was relaunched the ranks came back swapped (each rank on
the other's node); ``load()`` found no step both ranks hold, returned ``None`` and both ranks
trained again from step 0. Each scenario saves on 2 real gloo ranks with one memory root per
simulated node, then loads with the roots swapped, in the same processes.
"""

from __future__ import annotations

import pytest

import tierckpt
from tests.helpers.dist import run_ranks
from tests.helpers.state import assert_state_equal, from_wire, small_state, to_wire, zeros_like_state

NS = "unusable"

pytestmark = pytest.mark.slow


def _save_then_load(rank: int, save_roots: list[str], load_roots: list[str], local_mode: bool) -> dict:
    cfg = tierckpt.CheckpointConfig(namespace=NS, memory_dir=save_roots[rank], local_mode=local_mode)
    with tierckpt.Checkpointer(cfg) as ck:
        for step in (1, 2):
            ck.save(step, small_state(step, rank))
        ck.wait()
    sd = zeros_like_state(small_state(0, rank))
    load_cfg = cfg.replace(memory_dir=load_roots[rank])
    with tierckpt.Checkpointer(load_cfg) as ck:
        try:
            step = ck.load(sd)
        except tierckpt.TierckptError as exc:
            return {"error": type(exc).__name__, "message": str(exc), "steps": getattr(exc, "steps", None),
                    "missing": getattr(exc, "missing", None),
                    "not_found": isinstance(exc, tierckpt.CheckpointNotFoundError)}
        return {"step": step, "state": to_wire(sd)}


@pytest.mark.parametrize("local_mode", [True, False], ids=["local", "global"])
def test_swapped_ranks_raise_naming_what_exists(shm, local_mode: bool) -> None:
    roots = [shm("nodeA"), shm("nodeB")]
    outs = run_ranks(_save_then_load, 2, roots, roots[::-1], local_mode, timeout=120)
    for out in outs:
        assert out.get("error") == "NoUsableStepError", out
        assert out["not_found"] and out["steps"] == (1, 2), out
        assert set(out["missing"]) == {1, 2}, out
        message = out["message"]
        assert "rank 0" in message and "rank 1" in message, message
        assert "steps 1, 2" in message, message
        assert "durable tier" in message and "restart every rank on the node" in message, message  # what to do


def test_same_roots_still_load_and_empty_namespace_is_none(shm) -> None:
    roots = [shm("nodeA"), shm("nodeB")]
    outs = run_ranks(_save_then_load, 2, roots, roots, True, timeout=120)
    for rank, out in enumerate(outs):
        assert out["step"] == 2, out
        assert_state_equal(from_wire(out["state"]), small_state(2, rank))
    empty = [shm("emptyA"), shm("emptyB")]
    outs = run_ranks(_load_only, 2, empty, timeout=120)
    assert outs == [None, None]


def _load_only(rank: int, roots: list[str]) -> int | None:
    cfg = tierckpt.CheckpointConfig(namespace=NS, memory_dir=roots[rank], local_mode=True)
    with tierckpt.Checkpointer(cfg) as ck:
        return ck.load(zeros_like_state(small_state(0, rank)))


def test_lost_node_in_local_mode_survivor_renumbered_raises(shm) -> None:
    """The issue's scenario: node B survives as rank 0, the replacement for node A is empty."""
    roots = [shm("nodeA"), shm("nodeB")]
    replacement = shm("nodeA2")
    outs = run_ranks(_save_then_load, 2, roots, [roots[1], replacement], True, timeout=120)
    for out in outs:
        assert out.get("error") == "NoUsableStepError" and out["steps"] == (1, 2), out
        assert "rank 0 holds no step of its own, and rank 1's steps 1, 2" in out["message"], out
        assert "rank 1 holds no step of its own" in out["message"], out
