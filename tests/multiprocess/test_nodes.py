"""Two simulated nodes: each rank has its own memory root, the durable tier is shared.

Proves that a node that lost its memory tier reads its shards from the durable tier while
the other node reads from memory, for the same step; and that when the newest step lives
only in one node's memory, every rank falls back to the same older step (never a mix).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tierckpt
from tests.helpers.dist import run_ranks
from tests.helpers.state import assert_state_equal, from_wire, small_state, to_wire, zeros_like_state

NS = "nodes"

pytestmark = pytest.mark.slow


def _config(memory_dir: str, durable_url: str | None, **kw) -> tierckpt.CheckpointConfig:
    return tierckpt.CheckpointConfig(namespace=NS, memory_dir=memory_dir, durable_url=durable_url, **kw)


def _save(rank: int, node_dirs: list[str], durable_url: str, steps: list[int], every: int) -> list[list]:
    cfg = _config(node_dirs[rank], durable_url, memory_steps_retained=2, durable_every_n_steps=every)
    with tierckpt.Checkpointer(cfg) as ck:
        for step in steps:
            ck.save(step, small_state(step, rank))
        ck.wait()
        return [[i.step, sorted(i.tiers)] for i in ck.steps()]


def _load_dcp(rank: int, node_dirs: list[str], durable_url: str, step: int | None) -> dict:
    sd = zeros_like_state(small_state(0, rank))
    reader = tierckpt.TieredStorageReader(_config(node_dirs[rank], durable_url), step=step)
    try:
        dcp.load(sd, storage_reader=reader)
    except CheckpointException as exc:  # DCP wraps the reader's error; the reader keeps the original
        return {"error": type(reader.failure or exc).__name__, "message": str(reader.failure or exc)}
    return {"step": reader.step, "files": dict(reader.tiers_used), "state": to_wire(sd)}


def _load_checkpointer(rank: int, node_dirs: list[str], durable_url: str) -> dict:
    sd = zeros_like_state(small_state(0, rank))
    with tierckpt.Checkpointer(_config(node_dirs[rank], durable_url)) as ck:
        step = ck.load(sd)
        return {"step": step, "tiers": ck.last_load["tiers"], "state": to_wire(sd)}


def test_lost_node_reads_durable_while_other_node_reads_memory(shm, durable):
    url, _ = durable
    nodes = [shm("nodeA"), shm("nodeB")]
    listed = run_ranks(_save, 2, nodes, url, [1, 2, 3], 1)
    for steps in listed:  # every step durable, the newest two in each node's memory
        assert steps == [[1, ["durable"]], [2, ["durable", "memory"]], [3, ["durable", "memory"]]]
    own = ["__0_0.distcp", "__1_0.distcp"]

    # both nodes intact: each rank reads its own file from its own node's memory
    for rank, out in enumerate(run_ranks(_load_dcp, 2, nodes, url, None)):
        assert out["step"] == 3
        assert out["files"][own[rank]] == "memory", out["files"]
        assert_state_equal(from_wire(out["state"]), small_state(3, rank))

    shutil.rmtree(nodes[1])  # node B is lost with its memory tier
    for rank, out in enumerate(run_ranks(_load_dcp, 2, nodes, url, None)):
        assert out["step"] == 3
        if rank == 0:
            assert out["files"][own[0]] == "memory", out["files"]
        else:
            assert set(out["files"].values()) == {"durable"}, out["files"]
        assert_state_equal(from_wire(out["state"]), small_state(3, rank))

    loaded = run_ranks(_load_checkpointer, 2, nodes, url)
    assert [o["step"] for o in loaded] == [3, 3]
    assert "memory" in loaded[0]["tiers"] and loaded[1]["tiers"] == ["durable"]
    for rank, out in enumerate(loaded):
        assert_state_equal(from_wire(out["state"]), small_state(3, rank))


def test_newest_step_only_in_one_nodes_memory_agrees_on_older_durable_step(shm, durable):
    url, root = durable
    nodes = [shm("nodeA"), shm("nodeB")]
    # durable every 2 steps: step 2 is durable, step 3 lives only in the nodes' memory
    run_ranks(_save, 2, nodes, url, [1, 2, 3], 2)
    assert sorted(p.name for p in (root / NS).glob("step_*")) == ["step_2"]
    assert (Path(nodes[0]) / NS / "step_3" / "COMMITTED").is_file()
    shutil.rmtree(nodes[1])  # node B lost step 3; nobody else holds rank 1's shard of it

    # latest: both ranks load step 2 (rank 0 must not load its own newer step 3)
    for rank, out in enumerate(run_ranks(_load_dcp, 2, nodes, url, None)):
        assert out["step"] == 2
        assert_state_equal(from_wire(out["state"]), small_state(2, rank))
        if rank == 1:
            assert set(out["files"].values()) == {"durable"}
    loaded = run_ranks(_load_checkpointer, 2, nodes, url)
    assert [o["step"] for o in loaded] == [2, 2]
    for rank, out in enumerate(loaded):
        assert_state_equal(from_wire(out["state"]), small_state(2, rank))

    # asking for step 3 explicitly: every rank gets the same typed error, nothing loaded
    outs = run_ranks(_load_dcp, 2, nodes, url, 3)
    assert [o.get("error") for o in outs] == ["IntegrityError", "IntegrityError"], outs


def _save_dcp(rank: int, node_dirs: list[str], durable_url: str, steps: list[int]) -> dict:
    cfg = _config(node_dirs[rank], durable_url, memory_steps_retained=2)
    for step in steps:
        dcp.save(small_state(step, rank), storage_writer=tierckpt.TieredStorageWriter(cfg, step=step, durable=True))
    ns = Path(node_dirs[rank]) / NS
    return {
        "committed": sorted(p.name for p in ns.glob("step_*") if (p / "COMMITTED").is_file()),
        "slots": sorted(p.name for p in (ns / ".slots" / f"rank_{rank}").iterdir()),
    }


def test_dcp_plugins_on_two_nodes_load_the_same_step(shm, durable):
    url, root = durable
    nodes = [shm("nodeA"), shm("nodeB")]
    outs = run_ranks(_save_dcp, 2, nodes, url, [1, 2, 3])
    assert sorted(p.name for p in (root / NS).glob("step_*")) == ["step_1", "step_2", "step_3"]
    assert outs[0]["committed"] == ["step_2", "step_3"]  # the coordinator's node
    loaded = run_ranks(_load_dcp, 2, nodes, url, None)
    for rank, out in enumerate(loaded):
        assert out["step"] == 3
        assert_state_equal(from_wire(out["state"]), small_state(3, rank))
    assert loaded[0]["files"]["__0_0.distcp"] == "memory"


def test_dcp_plugins_on_two_nodes_commit_each_nodes_memory(shm, durable):
    url, _ = durable
    nodes = [shm("nodeA"), shm("nodeB")]
    outs = run_ranks(_save_dcp, 2, nodes, url, [1, 2, 3, 4])
    for rank, out in enumerate(outs):
        # every node's memory tier holds the newest steps (metadata reachable on every node) and
        # its slots are recycled by retention instead of growing with every save
        assert out["committed"] == ["step_3", "step_4"], (rank, out)
        assert len(out["slots"]) <= 3, (rank, out)
    for rank, out in enumerate(run_ranks(_load_dcp, 2, nodes, url, None)):
        assert out["step"] == 4
        assert out["files"][f"__{rank}_0.distcp"] == "memory", out["files"]
        assert_state_equal(from_wire(out["state"]), small_state(4, rank))
