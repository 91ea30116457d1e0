"""``Agent``: one node's service. Replicates, serves peers, fetches for loads, keeps the budget.

Threads: the two listeners (``server``), and one loop that wakes on a commit notice or every
``scan_interval_s``: learn the peers' node ids (all peers asked at once, within a deadline),
start replicating each namespace's newest own step to the ring successors that lack it (one
thread per target: ``replicate``), then enforce the node budget. Peer requests run in their
connection's thread; a replica is reserved against the budget, staged, verified against its
manifest, then committed with one rename (``receive``), so one that is not complete and
verified never counts.

The agent's state is a ``NodeState`` (``state``); the handlers take it, never the ``Agent``.
This module is the only one that knows the state, the handlers and the listeners together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierckpt import layout
from tierckpt.agent import local
from tierckpt.agent import protocol as p
from tierckpt.agent.client import Connection, PeerClient, ask_all
from tierckpt.agent.config import USER_SECRET, AgentConfig, user_secret
from tierckpt.agent.drain import refresh_drain_lag
from tierckpt.agent.metrics import AgentMetrics
from tierckpt.agent.protect import refresh as refresh_protected
from tierckpt.agent.receive import receive_replica
from tierckpt.agent.replicate import Replicator
from tierckpt.agent.serve import serve_get, serve_list
from tierckpt.agent.server import LocalServer, PeerServer
from tierckpt.agent.state import NodeState
from tierckpt.agent.store import Held, NodeStore
from tierckpt.observability import get_logger

__all__ = ["Agent"]

_log = get_logger("agent")
PEER_REFRESH_S = 5.0
DRAIN_CHECK_S = 30.0  # listing an S3 durable tier every scan would be a LIST a second per namespace
REPLICATION_WAIT_S = 5.0  # a round waits this long for its sends, then goes on (they continue)


class Agent:
    """The node service; see ``tierckpt.agent.start_agent`` for hosting it."""

    def __init__(self, config: AgentConfig) -> None:
        self.node_id = config.node_id
        # on loopback without a job secret: this user's own (other local users are not trusted)
        self.state = NodeState(config, config.secret or user_secret())
        self._stop = threading.Event()
        self._peers_checked = 0.0
        self._configured_peers = config.peers  # --peers; set_peers replaces only the discovered ones
        self._refresher: threading.Thread | None = None
        self.replicator = Replicator(self.state)
        self.peer_server = PeerServer(*config.listen, node_id=self.node_id, secret=self.secret, limits=config.limits,
                                      insecure_wire=config.insecure_wire, handle_peer=self.handle_peer,
                                      rejected=self.metrics.rejected.inc)
        self.address = self.state.address = self.peer_server.address
        try:
            self.local_server = LocalServer(Path(config.memory_dir) / layout.AGENT_SOCKET,
                                            handle_local=self.handle_local, idle_s=config.limits.local_idle_s)
        except BaseException:  # another agent serves this root (AgentRunningError): leave no listener behind
            self.peer_server.close()
            raise
        self._loop = threading.Thread(target=self._run, name="tierckpt-agent-loop", daemon=True)
        self._loop.start()
        _log.info("[Agent %s] serving %s on %s:%d (peers: %s, replicas: %d)", self.node_id, config.memory_dir,
                  *self.address, ", ".join(f"{h}:{q}" for h, q in config.peers) or "none", config.replicas)
        if config.insecure_wire:
            self.metrics.insecure_wire.set(1)
            _log.warning("[Agent %s] WARNING: --insecure-wire: checkpoint bytes go to and from peers UNENCRYPTED and "
                         "WITHOUT STREAM INTEGRITY; anyone on the network path can read them, and alter them within "
                         "what the item checksums catch. Use it only on a fabric you trust.", self.node_id)
        if not config.secret:
            _log.info("[Agent %s] no job secret: peers on this host authenticate with this user's own secret "
                      "(%s)", self.node_id, USER_SECRET)

    # -- the state, as the agent's hosts and tests see it ---------------------------------
    @property
    def config(self) -> AgentConfig:
        return self.state.config

    @property
    def store(self) -> NodeStore:
        return self.state.store

    @property
    def metrics(self) -> AgentMetrics:
        return self.state.metrics

    @property
    def secret(self) -> bytes:
        return self.state.secret

    @property
    def owner_token(self) -> str:
        return self.state.owner_token

    @property
    def peer_ids(self) -> dict[tuple[str, int], str]:
        return self.state.peer_ids

    @property
    def peers_down(self) -> set[tuple[str, int]]:
        return self.state.peers_down

    @property
    def replicated(self) -> dict[str, tuple[int, str, frozenset[str]]]:
        return self.state.replicated

    def close(self) -> None:
        self._stop.set()
        self.state.wake()
        self._loop.join(timeout=10)
        self.local_server.close()
        self.peer_server.close()

    # -- the loop -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self.state.wait_for_round(self.config.scan_interval_s)
            if self._stop.is_set():
                return
            try:
                self.tick()
            except Exception as exc:  # the loop must outlive any one failure; logged, retried
                _log.warning("[Agent %s] scan failed: %s", self.node_id, exc)

    def tick(self) -> None:
        """One round: refresh peers, replicate newest steps, enforce the budget."""
        if time.monotonic() - self._peers_checked > PEER_REFRESH_S or len(self.peer_ids) < len(self.config.peers):
            self._refresh_peers_in_background()
        if self.config.replicas > 0:
            self.replicator.round(REPLICATION_WAIT_S)
        refresh_protected(self.state)
        self.enforce_budget(0)
        self.state.update_gauges()
        if self.config.durable_url is not None:
            self.refresh_drain_lag(list_durable=self.state.drain_due(DRAIN_CHECK_S))

    def refresh_drain_lag(self, *, list_durable: bool = True) -> dict[str, dict[str, Any]]:
        """Per namespace: the newest memory and durable steps and the lag between them (``drain``)."""
        return refresh_drain_lag(self.state, list_durable=list_durable)

    def set_peers(self, discovered: Sequence[tuple[str, int]]) -> None:
        """Peers found at run time (``tierckpt run`` publishes every hosted agent's address in the
        rendezvous store): the configured ``--peers`` plus these, replacing the ones discovered
        before. A node that left the job leaves the list with the next call: a lost host drops
        connections instead of refusing them, and each load's catalog would otherwise wait the
        whole ``peer_deadline_s`` for it until the next refresh marked it down."""
        own = {self.address, ("127.0.0.1", self.address[1])}
        merged = tuple(dict.fromkeys((*self._configured_peers, *(a for a in discovered if a not in own))))
        if not self.state.replace_peers(merged):
            return
        self._peers_checked = 0.0
        self.state.wake()

    def _refresh_peers_in_background(self) -> None:
        """Start a refresh unless one runs: the round goes on with the ids known so far, so a
        stuck peer holds up neither the budget nor the drain lag (the refresh waits on it alone)."""
        if self._refresher is not None and self._refresher.is_alive():
            return
        self._peers_checked = time.monotonic()
        self._refresher = threading.Thread(target=self._refresh_peers, name="tierckpt-agent-peers", daemon=True)
        self._refresher.start()
        self._refresher.join(0.5)  # peers that answer at once are in this round's ring

    def _refresh_peers(self) -> None:
        """Every peer's node id, all asked at once; one that does not answer within the deadline is
        left out of the ring until it does."""
        self._peers_checked = time.monotonic()
        deadline = self.config.limits.peer_deadline_s

        def node_of(addr: tuple[str, int]) -> str:
            client = self.connect(addr, timeout=deadline)
            client.close()
            return client.node

        peers = self.config.peers
        self.state.record_peers(peers, ask_all(peers, node_of, deadline))

    def _replicate_newest(self, ns: str) -> None:
        """One namespace's replication, waited for (``tierckpt bench replication`` times it)."""
        self.replicator.now(ns)

    def targets(self) -> list[tuple[str, tuple[str, int]]]:
        return self.state.targets()

    # -- peer requests (receiver) -----------------------------------------------------------
    def connect(self, address: tuple[str, int], timeout: float = 30.0) -> PeerClient:
        """An authenticated connection to the agent at ``address``, on this agent's wire."""
        return self.state.connect(address, timeout)

    def handle_peer(self, req: p.Request, conn: Connection, peer: str) -> None:
        if isinstance(req, p.ListSteps):
            serve_list(self.state, req, conn)
        elif isinstance(req, p.Get):
            serve_get(self.state, req, conn)
        elif isinstance(req, p.Put):
            receive_replica(self.state, req, conn, peer)
        else:
            conn.send({"op": "status", **self.status()})

    # -- local requests -------------------------------------------------------------------
    def handle_local(self, req: dict[str, Any]) -> dict[str, Any] | None:
        return local.handle(self.state, req)

    # -- the state's methods, delegated -----------------------------------------------------
    def enforce_budget(self, extra: int) -> bool:
        return self.state.enforce_budget(extra)

    def reserve(self, nbytes: int) -> str | None:
        return self.state.reserve(nbytes)

    def release(self, nbytes: int) -> None:
        self.state.release(nbytes)

    def settle(self) -> None:
        self.state.settle()

    def evict(self, victim: Held) -> None:
        self.state.evict(victim)

    def status(self) -> dict[str, Any]:
        return self.state.status()

    def restoring(self) -> bool:
        return self.state.restoring()

    def count_prefetch(self, delta: int) -> None:
        self.state.count_prefetch(delta)

    def fetch_lock(self, key: tuple[str, int, str]) -> threading.Lock:
        return self.state.fetch_lock(key)
