"""The protected steps (``<root>/<ns>/.keep``) follow the replicas an agent holds: two agents in
this process on loopback, node-b replicating to node-a; node-a's own saves (retention 2) keep
the step node-b's replica is at, in every local rank's namespace of the same job."""

from __future__ import annotations

from pathlib import Path

import torch

import tierckpt
from tests.agent.conftest import wait_for
from tierckpt.agent.store import NodeStore
from tierckpt.node.keep import read_protected

NS = "keep-job"
SECRET = b"job-secret-keep"


def _save(memory_dir: str, ns: str, steps: list[int]) -> None:
    cfg = tierckpt.CheckpointConfig(namespace=ns, memory_dir=memory_dir, memory_steps_retained=2)
    with tierckpt.Checkpointer(cfg) as ck:
        for s in steps:
            ck.save(s, {"w": torch.full((128,), float(s))})
            ck.wait()


def _own(memory_dir: str, ns: str) -> list[int]:
    return [s.step for s in NodeStore(memory_dir, "x").own(ns).list_steps()]


def test_protected_steps_follow_the_replicas_held(node_dir, agent) -> None:
    a_dir, b_dir = node_dir("a"), node_dir("b")
    a = agent(memory_dir=a_dir, node_id="node-a", secret=SECRET)  # no peers: it only receives
    agent(memory_dir=b_dir, node_id="node-b", peers=(a.address,), secret=SECRET)
    ranks_a = [f"{NS}--rank0", f"{NS}--rank1"]  # local mode: node-a's two ranks
    for ns in ranks_a:
        _save(a_dir, ns, [1, 2])
    _save(b_dir, f"{NS}--rank2", [1, 2, 3])  # node-b's rank, replicated to node-a
    keep = [Path(a_dir, ns) for ns in ranks_a]
    wait_for(lambda: all(read_protected(d) == {3} for d in keep), "step 3 protected on both of node-a's ranks")
    assert a.status()["protected"] == {ns: [3] for ns in ranks_a}
    for ns in ranks_a:  # node-a trains on; node-b's replica stays at 3 (it lags)
        _save(a_dir, ns, [3, 4, 5, 6])
        assert _own(a_dir, ns) == [3, 5, 6]  # retention 2, and step 3 for the replica
    _save(b_dir, f"{NS}--rank2", [8])  # the replica advances: 3 is no longer protected
    wait_for(lambda: all(read_protected(d) == {8} for d in keep), "the protection to move to step 8")
    for ns in ranks_a:
        _save(a_dir, ns, [7, 8, 9, 10])
        assert _own(a_dir, ns) == [8, 9, 10]
    replica = [s.step for s in NodeStore(a_dir, "node-a").replica("node-b", f"{NS}--rank2").list_steps()]
    assert 8 in replica


def test_a_replica_whose_step_is_gone_here_does_not_move_the_protection(node_dir, agent) -> None:
    """node-a no longer holds step 4 when node-b's replica of 4 arrives: the step it protects
    stays 2 (still held here, and the older replica is still offered), not 4 (useless)."""
    a_dir, b_dir = node_dir("a"), node_dir("b")
    a = agent(memory_dir=a_dir, node_id="node-a", secret=SECRET)
    agent(memory_dir=b_dir, node_id="node-b", peers=(a.address,), secret=SECRET)
    own_ns = f"{NS}--rank0"
    _save(a_dir, own_ns, [1, 2])
    _save(b_dir, f"{NS}--rank1", [1, 2])
    wait_for(lambda: read_protected(Path(a_dir, own_ns)) == {2}, "step 2 protected on node-a")
    _save(a_dir, own_ns, [3, 4, 5, 6])
    assert _own(a_dir, own_ns) == [2, 5, 6]
    # node-b keeps step 2 (its own newest replicated step), so node-a keeps its replica of 2 as well
    _save(b_dir, f"{NS}--rank1", [4])
    wait_for(lambda: 4 in [s.step for s in NodeStore(a_dir, "node-a").replica("node-b", f"{NS}--rank1").list_steps()],
             "the replica of step 4")
    a.tick()
    assert read_protected(Path(a_dir, own_ns)) == {2}


def test_every_step_replicates_when_its_slots_are_reused(node_dir, agent) -> None:
    """From the fourth save on, a rank's steps reuse the shared-memory slots of deleted ones (same
    inode, size and mtime: the bytes change through a mapping). Each is replicated all the same:
    the sender's digest cache is keyed by the save, not by the file's stat (a stale digest made
    every put fail its authentication tag, so the replica lagged at the third step)."""
    a_dir, b_dir = node_dir("a"), node_dir("b")
    a = agent(memory_dir=a_dir, node_id="node-a", secret=SECRET)
    agent(memory_dir=b_dir, node_id="node-b", peers=(a.address,), secret=SECRET)
    ns = f"{NS}--rank1"
    cfg = tierckpt.CheckpointConfig(namespace=ns, memory_dir=b_dir, memory_steps_retained=2)
    replica = NodeStore(a_dir, "node-a").replica("node-b", ns)
    with tierckpt.Checkpointer(cfg) as ck:
        for s in range(1, 8):
            ck.save(s, {"w": torch.full((1 << 16,), float(s))})
            ck.wait()
            wait_for(lambda s=s: s in [x.step for x in replica.list_steps()], f"the replica of step {s}", 15)
    assert a.status()["replicas_held"]["node-b"][ns][-1] == 7  # verified against its manifest when stored
