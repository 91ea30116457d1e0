"""The node agent (``tierckpt agent``): one per node, beside the trainers, never in their way.

It owns the node's memory tier across namespaces: after each memory commit (a notice on
``<memory root>/.agent.sock``, or its own rescans) it replicates this node's files of each
namespace's newest step to ``replicas`` peers on a stable ring over node ids (``sendfile``
from the shared-memory files; the receiver verifies every checksum and commits with the
marker last); it serves those replicas and its own steps to peers and, for loads on this
node, fetches what the memory tier lacks from peers (the ``peer`` tier); it keeps the node
within a memory budget and drains newest steps to the durable tier on ``flush``.

Hosting it (the launcher does this for its node; tests and services do the same)::

    from tierckpt.agent import AgentConfig, start_agent
    handle = start_agent(AgentConfig(memory_dir="/dev/shm/tierckpt", listen=("0.0.0.0", 7601),
                                     peers=(("node1", 7601),), replicas=1, secret=b"...",
                                     budget_bytes=None, durable_url="s3://bucket/ckpt"))
    handle.address        # ("0.0.0.0", 7601): the bound TCP address (port 0 picks one)
    handle.node_id        # the node's stable id (default: host + memory root)
    handle.prefetch(ns, ranks)  # a replacement: pull these ranks' newest state from peers now
    handle.flush()        # drain each namespace's newest memory step to durable; the reply
    handle.status()       # what `tierckpt agent status` prints, as a dict
    handle.close()        # stop listening (replicas and steps stay in the memory root)

In a separate process: ``python -m tierckpt.agent serve --memory-dir DIR ...`` (the same as
``tierckpt agent serve``); it prints ``listening on HOST:PORT node NODE`` once ready.
Trainers find the agent by its socket in their ``memory_dir``; nothing else is configured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tierckpt.agent.config import AgentConfig
from tierckpt.agent.service import Agent

if TYPE_CHECKING:
    from tierckpt.agent.prefetch import PrefetchJob

__all__ = ["AgentConfig", "AgentHandle", "start_agent"]


class AgentHandle:
    """A running agent in this process."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._closed = False
        self.address: tuple[str, int] = agent.address
        self.node_id: str = agent.node_id
        self.config: AgentConfig = agent.config

    def status(self) -> dict[str, Any]:
        return self._agent.status()

    def flush(self, namespace: str | None = None) -> dict[str, Any]:
        from tierckpt.agent.drain import flush

        return flush(self._agent.state, namespace)

    def set_peers(self, peers: Sequence[tuple[str, int]]) -> None:
        """Peers found at run time (the rendezvous store under ``tierckpt run``): ``--peers`` plus
        these, replacing the ones a previous call gave (a node that left the job leaves the list)."""
        self._agent.set_peers(peers)

    def prefetch(self, namespace: str, ranks: Sequence[int],
                 on_done: Callable[[PrefetchJob], None] | None = None) -> PrefetchJob:
        """Pull ``ranks``' newest state of ``namespace`` (local or global mode) from peers into this
        node's peer cache, in the background (``agent.prefetch``); a load waits for a file in flight."""
        from tierckpt.agent.prefetch import start

        return start(self._agent.state, namespace, ranks, on_done)

    def replicated_steps(self) -> dict[str, int]:
        """Own namespace → the newest step replicated to at least one target (``tierckpt run``'s
        drain waits for it: the spare that takes a drained node's rank loads that step)."""
        return self._agent.state.replicated_steps()

    def tick(self) -> None:
        """Run one replication and budget round now (tests; the agent also runs them itself)."""
        self._agent.tick()

    def close(self) -> None:
        """Stop the agent; a second call does nothing."""
        if not self._closed:
            self._closed = True
            self._agent.close()

    def __enter__(self) -> AgentHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_agent(config: AgentConfig) -> AgentHandle:
    """Start an agent in this process (daemon threads); returns once it listens."""
    return AgentHandle(Agent(config))
