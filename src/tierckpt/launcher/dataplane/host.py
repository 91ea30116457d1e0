"""The launcher's half of the node agent: host it (or find one serving), publish and discover the
other nodes' agents through the job store, prefetch on joining, flush at exit.

``tierckpt run`` hosts the node agent (``tierckpt.agent``) in its own process unless one already
serves the memory dir. Its peers come from the rendezvous store: every node publishes its agent's
address for the membership (the generation the membership formed in) and reads the others', at
most once a second until all are known, and again after every new membership, so ``--replicas``
needs no ``--peers`` list. Right after a round, a replacement's agent pulls its ranks' newest state
from the peers while the workers start (prefetch.py). At exit the agent flushes to the durable tier.

Call order (the supervisor's):

    host = NodeAgentHost(agent_config, events, across_hosts=...)   # once
    host.start(generation, job_secret)     # before the first round (loopback), or after it (across hosts:
                                           # the job's generated secret comes from the store)
    host.follow(membership, node, nnodes)  # after every round or regroup
    host.discover(ctl, local_host, generation)                 # every poll (rate-limited)
    host.prefetch(ctl, local_host, namespace, ranks, generation, wait_s)  # after a round, before the workers
    host.flush()                           # at exit, before the persisted event (None: no agent hosted)
    host.close()
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tierckpt.launcher.control.store import store_errors
from tierckpt.launcher.events import Events

if TYPE_CHECKING:
    from tierckpt.agent import AgentConfig
    from tierckpt.launcher.control.jobcontrol import JobControl

__all__ = ["NodeAgentHost", "hosted_agent_config", "local_address"]


class NodeAgentHost:
    """See the module docstring for the call order."""

    def __init__(self, config: AgentConfig | None, events: Events, *, across_hosts: bool) -> None:
        self.config = config
        self.events = events
        self.across_hosts = across_hosts
        self.agent: Any = None  # the hosted AgentHandle (None: none hosted)
        self._next = 0.0  # when to look for other nodes' agents in the store next
        self._published: tuple[int, int] | None = None  # (node, nnodes) last published
        self._membership = 0  # the generation the current membership formed in (discovery's key)
        self._node, self._nnodes = 0, 1

    def start(self, generation: int, job_secret: Callable[[], bytes]) -> None:
        """Host the node agent, unless none is configured or one already serves the memory dir."""
        cfg = self.config
        if cfg is None or self.agent is not None:
            return
        from tierckpt.errors import AgentRunningError, StorageError
        from tierckpt.tiers import peer

        served = f"a node agent already serves {cfg.memory_dir}; not hosting another"
        try:
            peer.local_request(cfg.memory_dir, {"op": "status"}, timeout=2.0)
            self.events.emit("warning", generation=generation, what=served)
            return
        except StorageError:  # no agent answers: host one
            pass
        from tierckpt.agent import start_agent

        cfg = hosted_agent_config(cfg, across_hosts=self.across_hosts, job_secret=job_secret)
        try:
            self.agent = start_agent(cfg)
        except AgentRunningError:  # another launcher on this memory root bound it since the probe
            self.events.emit("warning", generation=generation, what=served)
            return
        self.events.emit("agent", generation=generation, address=list(self.agent.address),
                         node_id=self.agent.node_id, replicas=cfg.replicas)

    def follow(self, membership: int, node: int, nnodes: int) -> None:
        """A new membership: publish this agent's address again, look for the others at once."""
        self._membership, self._node, self._nnodes = membership, node, nnodes
        self._next = 0.0
        self._published = None

    def discover(self, ctl: JobControl | None, local_host: Callable[[], str], wait_s: float = 0.0) -> None:
        """Publish this agent's address and hand it the others' (once a second until all are known).
        ``local_host``: this node's address for the others when the agent listens on every interface;
        ``wait_s``: right after a round, wait that long for the others' addresses."""
        agent = self.agent
        if agent is None or ctl is None or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + 1.0
        host, port = agent.address
        if host in ("", "0.0.0.0", "::"):
            host = local_host()
        try:
            if self._published != (self._node, self._nnodes):
                ctl.publish_agent(self._membership, self._node, host, port)
                self._published = (self._node, self._nnodes)
            found = [a for a in ctl.agents(self._membership, self._nnodes, wait_s) if a != (host, port)]
        except store_errors():
            return  # the store's host is gone: the liveness check reports it
        if len(found) >= self._nnodes - 1:
            self._next = float("inf")  # all known; a new membership publishes again
        agent.set_peers(found)

    def prefetch(self, ctl: JobControl | None, local_host: Callable[[], str], namespace: str | None,
                 ranks: Sequence[int], generation: int, wait_s: float) -> None:
        """Right after a round, before the workers start: the peers of the new membership, then the
        agent pulls this node's ranks' newest state from them if its memory lacks it (prefetch.py)."""
        if self.agent is None:
            return
        self.discover(ctl, local_host, wait_s=wait_s)
        from tierckpt.launcher.dataplane import prefetch

        prefetch.start(self.agent, namespace, list(ranks), self.events, generation)

    def flush(self) -> Any:
        """Ask the hosted agent to flush to the durable tier and wait (its report); None: no agent."""
        return None if self.agent is None else self.agent.flush()

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None


def hosted_agent_config(cfg: AgentConfig, *, across_hosts: bool, job_secret: Callable[[], bytes]) -> AgentConfig:
    """The hosted agent's config: for peers on other hosts (``options.agent_across_hosts``) it
    listens on every interface, with the user's secret if one was given, else the job's generated
    one (``job_secret``, read from the rendezvous store only then)."""
    if not across_hosts:
        return cfg
    return dataclasses.replace(cfg, listen=("0.0.0.0", cfg.listen[1]), secret=cfg.secret or job_secret())


def local_address(rdzv_host: str) -> str:
    """This node's address for the others: loopback for a loopback rendezvous, else its FQDN."""
    if rdzv_host in ("localhost", "::1") or rdzv_host.startswith("127."):
        return "127.0.0.1"
    return socket.getfqdn()
