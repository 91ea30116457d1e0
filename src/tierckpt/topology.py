"""Where a rank sits: which ranks share its node, and the side groups background work uses.

Built once by ``Checkpointer.__init__`` on every rank (one ``all_gather_object`` on the
training group, then ``new_group`` calls in the same order everywhere). Background commits
run their collectives on ``commit_group`` and durable drains on ``drain_group``, never on
the training group, in the same order on every rank.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch.distributed as dist

from tierckpt import layout
from tierckpt.config import CheckpointConfig
from tierckpt.errors import ProtocolError
from tierckpt.runtime import RankRuntime

__all__ = ["NodeTopology"]


class NodeTopology:
    """Rank, world size, node membership and the side groups of one ``Checkpointer``.

    node_leader              the lowest rank sharing this node's memory root (frees slots of
                             dead processes, commits other nodes' copies)
    shares_coordinator_node  this node's memory root is rank 0's
    multi_node               more than one memory root in the job
    """

    def __init__(self, config: CheckpointConfig, process_group: dist.ProcessGroup | None) -> None:
        self.group = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        self.node_leader, self.shares_coordinator_node, self.multi_node = True, True, False
        self.commit_group: dist.ProcessGroup | None = None
        self.drain_group: dist.ProcessGroup | None = None
        if not (self.distributed and self.world_size > 1):
            return
        ranks = dist.get_process_group_ranks(process_group) if process_group else None
        if config.local_mode:
            # one side group, used only by load's agreement: saves need no collective at all
            self.commit_group = dist.new_group(ranks=ranks, backend="gloo")
            return
        me = (socket.gethostname(), os.path.realpath(config.memory_dir))
        nodes: list[Any] = [None] * self.world_size
        dist.all_gather_object(nodes, me, group=process_group)
        self.node_leader = nodes.index(me) == self.rank
        self.shares_coordinator_node = nodes[0] == me
        self.multi_node = len(set(nodes)) > 1
        self.commit_group = dist.new_group(ranks=ranks, backend="gloo")
        if config.durable_url is not None:
            self.drain_group = dist.new_group(ranks=ranks, backend="gloo")

    def commit_other_nodes(self, runtime: RankRuntime, step: int, save_id: str | None,
                           small: tuple[bytes, bytes] | None) -> tuple[bytes, bytes] | None:
        """Make the step visible in every node's memory tier, not just the coordinator's.

        Called by every rank after its commit, on the committer thread; returns the step's
        (metadata, manifest) bytes as the coordinator wrote them.
        """
        if not self.multi_node:
            return small
        box = [small]
        group = self.commit_group
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        small = box[0]
        if small is None or save_id is None:
            raise ProtocolError(f"step {step}: the coordinator broadcast no metadata to commit on this node",
                                rank=self.rank, step=step)
        if self.node_leader and not self.shares_coordinator_node:
            md, mf = small
            runtime.memory.commit(step, save_id, {layout.METADATA: md, layout.MANIFEST: mf})
            runtime.committed_in_memory(step)
            runtime.apply_retention(runtime.memory, runtime.memory_retention)
        return small
