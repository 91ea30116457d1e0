"""``Agent``: one node's service. Replicates, serves peers, fetches for loads, keeps the budget.

Threads: the two listeners (``server``), and one loop that wakes on a commit notice or every
``scan_interval_s``: learn the peers' node ids (all peers asked at once, within a deadline),
start replicating each namespace's newest own step to the ring successors that lack it (one
thread per target: ``replicate``), then enforce the node budget. Peer requests run in their
connection's thread; a replica is reserved against the budget, staged, verified against its
manifest, then committed with one rename (``receive``), so one that is not complete and
verified never counts.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tierckpt import layout
from tierckpt.agent import protocol as p
from tierckpt.agent import safefs
from tierckpt.agent.client import Connection, PeerClient, ask_all
from tierckpt.agent.config import USER_SECRET, AgentConfig, user_secret
from tierckpt.agent.metrics import AgentMetrics, LoadWaits
from tierckpt.agent.protect import refresh as refresh_protected
from tierckpt.agent.receive import receive_replica
from tierckpt.agent.replicate import Replicator
from tierckpt.agent.serve import serve_get, serve_list
from tierckpt.agent.server import LocalServer, PeerServer
from tierckpt.agent.store import Held, NodeStore, select_evictions
from tierckpt.observability import get_logger

__all__ = ["Agent", "ring_targets"]

_log = get_logger("agent")
PEER_REFRESH_S = 5.0
DRAIN_CHECK_S = 30.0  # listing an S3 durable tier every scan would be a LIST a second per namespace
REPLICATION_WAIT_S = 5.0  # a round waits this long for its sends, then goes on (they continue)
OWNER_FILE = ".agent-owner"  # this node's owner token: only its holder may replace or delete its replicas


def ring_targets(nodes: Sequence[str], me: str, k: int) -> list[str]:
    """The ``k`` nodes after ``me`` on the ring of sorted node ids (never ``me``)."""
    ring = sorted(set(nodes) | {me})
    i = ring.index(me)
    return [ring[(i + j) % len(ring)] for j in range(1, min(k, len(ring) - 1) + 1)]


@dataclass(frozen=True)
class Holder:
    """Where a peer file can be fetched: another agent, or this node's own replica area."""

    node: str
    address: tuple[str, int] | None  # None: a replica on this node
    origin: str
    save_id: str
    held: dict[str, int]


class Agent:
    """The node service; see ``tierckpt.agent.start_agent`` for hosting it."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.node_id = config.node_id
        self.store = NodeStore(config.memory_dir, config.node_id)
        self.metrics = AgentMetrics()
        self.peer_ids: dict[tuple[str, int], str] = {}
        self.peers_down: set[tuple[str, int]] = set()  # peers that did not answer the last refresh
        self.replicated: dict[str, tuple[int, str, frozenset[str]]] = {}  # ns → (step, save id, nodes)
        self._holders: dict[tuple[str, int], list[Holder]] = {}
        self._fetch_locks: dict[tuple[str, int, str], threading.Lock] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._peers_checked = 0.0
        self._configured_peers = config.peers  # --peers; set_peers replaces only the discovered ones
        self.drain_state: dict[str, Any] = {}
        self.drain_lag: dict[str, dict[str, Any]] = {}
        self._drain_checked = float("-inf")
        self.last_replication: dict[str, Any] = {}
        self.last_fetch: dict[str, Any] = {}
        self.last_prefetch: dict[str, Any] = {}  # agent.prefetch: the last prefetch on join
        self._prefetches = 0  # prefetches in flight: replicas sent here wait until they end
        self.load_waits = LoadWaits()  # per step: how long loads' fetch requests waited (agent.prefetch)
        self._reserved = 0
        self._puts: set[tuple[str, str, int]] = set()
        self.protect_lock = threading.Lock()
        self.protected: dict[str, set[int]] = {}  # own namespace → the steps its .keep lists (agent.protect)
        self._refresher: threading.Thread | None = None
        Path(config.memory_dir).mkdir(parents=True, exist_ok=True)
        self.owner_token = _owner_token(config.memory_dir)
        self.store.gc()
        self.replicator = Replicator(self)
        # on loopback without a job secret: this user's own (other local users are not trusted)
        self.secret: bytes = config.secret or user_secret()
        self.peer_server = PeerServer(*config.listen, node_id=self.node_id, secret=self.secret, limits=config.limits,
                                      insecure_wire=config.insecure_wire, handle_peer=self.handle_peer,
                                      rejected=self.metrics.rejected.inc)
        self.address = self.peer_server.address
        self.local_server = LocalServer(Path(config.memory_dir) / layout.AGENT_SOCKET, handle_local=self.handle_local,
                                        idle_s=config.limits.local_idle_s)
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

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._loop.join(timeout=10)
        self.local_server.close()
        self.peer_server.close()

    # -- the loop -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.config.scan_interval_s)
            self._wake.clear()
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
        refresh_protected(self)
        self.enforce_budget(0)
        self._update_gauges()
        if self.config.durable_url is not None:
            self.refresh_drain_lag(list_durable=time.monotonic() - self._drain_checked > DRAIN_CHECK_S)

    def refresh_drain_lag(self, *, list_durable: bool = True) -> dict[str, dict[str, Any]]:
        """Per namespace: the newest memory and durable steps and the lag between them.

        ``list_durable`` False reuses the newest durable step found last time (listing an S3
        tier is a request; memory is read every time).
        """
        from tierckpt.agent.drain import drain_lag

        known = {ns: v["newest_durable"] for ns, v in self.drain_lag.items() if "newest_durable" in v}
        if list_durable:
            self._drain_checked = time.monotonic()
            known = {}
        self.drain_lag = {ns: drain_lag(self, ns, known) for ns in self.store.namespaces()}
        self.metrics.drain_lag.set(sum(int(v.get("lag_steps", 0)) for v in self.drain_lag.values()))
        return self.drain_lag

    def set_peers(self, discovered: Sequence[tuple[str, int]]) -> None:
        """Peers found at run time (``tierckpt run`` publishes every hosted agent's address in the
        rendezvous store): the configured ``--peers`` plus these, replacing the ones discovered
        before. A node that left the job leaves the list with the next call: a lost host drops
        connections instead of refusing them, and each load's catalog would otherwise wait the
        whole ``peer_deadline_s`` for it until the next refresh marked it down."""
        own = {self.address, ("127.0.0.1", self.address[1])}
        with self._lock:
            merged = tuple(dict.fromkeys((*self._configured_peers, *(a for a in discovered if a not in own))))
            if merged == self.config.peers:
                return
            self.config = replace(self.config, peers=merged)
            self.peers_down &= set(merged)
            self._peers_checked = 0.0
        self._wake.set()

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
        found = ask_all(peers, node_of, deadline)
        with self._lock:
            self.peer_ids = {addr: found[addr] for addr in peers if addr in found}
            # a load's catalog skips these until a refresh finds them again (a lost host would
            # otherwise cost every load the whole deadline)
            self.peers_down = {addr for addr in peers if addr not in found}

    def _replicate_newest(self, ns: str) -> None:
        """One namespace's replication, waited for (``tierckpt bench replication`` times it)."""
        self.replicator.now(ns)

    def targets(self) -> list[tuple[str, tuple[str, int]]]:
        by_node = {node: addr for addr, node in self.peer_ids.items() if node != self.node_id}
        return [(n, by_node[n]) for n in ring_targets(list(by_node), self.node_id, self.config.replicas)]

    # -- peer requests (receiver) -----------------------------------------------------------
    def connect(self, address: tuple[str, int], timeout: float = 30.0) -> PeerClient:
        """An authenticated connection to the agent at ``address``, on this agent's wire."""
        return PeerClient.connect(address, self.node_id, self.secret, timeout=timeout,
                                  insecure=self.config.insecure_wire)

    def handle_peer(self, req: p.Request, conn: Connection, peer: str) -> None:
        if isinstance(req, p.ListSteps):
            serve_list(self, req, conn)
        elif isinstance(req, p.Get):
            serve_get(self, req, conn)
        elif isinstance(req, p.Put):
            receive_replica(self, req, conn, peer)
        else:
            conn.send({"op": "status", **self.status()})

    def begin_put(self, key: tuple[str, str, int]) -> bool:
        """Claim (origin, namespace, step) for one connection's put; False if another has it."""
        with self._lock:
            if key in self._puts:
                return False
            self._puts.add(key)
            return True

    def end_put(self, key: tuple[str, str, int]) -> None:
        with self._lock:
            self._puts.discard(key)
        refresh_protected(self)

    # -- local requests -------------------------------------------------------------------
    def handle_local(self, req: dict[str, Any]) -> dict[str, Any] | None:
        from tierckpt.agent import local  # the load-time half lives there

        return local.handle(self, req)

    # -- budget ---------------------------------------------------------------------------
    def enforce_budget(self, extra: int) -> bool:
        """Evict until ``extra`` more bytes (beyond those reserved by puts in flight) fit the node
        budget; False if they cannot."""
        budget = self.config.budget_bytes
        if budget is None:
            return True
        with self._lock:  # bytes of puts in flight count once staged; reservations only gate admission
            return self._evict_to(budget - extra)

    def _evict_to(self, target: int) -> bool:
        used = self.store.usage_bytes()
        if used <= target:
            return True
        for victim in select_evictions(self.store.everything(), used - target, ("cache", "replica")):
            self.evict(victim)
            used = self.store.usage_bytes()
            if used <= target:
                return True
        return used <= target

    def reserve(self, nbytes: int) -> str | None:
        """Reserve room for a replica before its bytes come; None when reserved, else why not.

        Nothing is evicted here: only what eviction could free is counted on (``settle`` evicts
        once the bytes are there). With no budget, the filesystem's free space is the cap.
        """
        budget = self.config.budget_bytes
        with self._lock:
            if budget is None:
                st = os.statvfs(self.config.memory_dir)
                free = st.f_bavail * st.f_frsize - int(self.config.limits.free_space_margin * st.f_blocks * st.f_frsize)
                if self._reserved + nbytes > free:
                    return f"no room for {nbytes} bytes: {max(free, 0)} bytes free on the memory filesystem"
            else:
                evictable = sum(h.nbytes for h in select_evictions(self.store.everything(), 1 << 62,
                                                                    ("cache", "replica")))
                if self.store.usage_bytes() + self._reserved + nbytes - evictable > budget:
                    return f"no room for {nbytes} bytes within the node budget ({budget} bytes)"
            self._reserved += nbytes
            return None

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes

    def settle(self) -> None:
        """A reserved replica's bytes are staged (counted in usage now): evict what the budget needs."""
        budget = self.config.budget_bytes
        if budget is not None:
            with self._lock:
                self._evict_to(budget)

    def evict(self, victim: Held) -> None:
        self.store.delete(victim)
        self.metrics.evictions.inc(kind=victim.kind)
        _log.warning("[Agent %s] Step %d: evicted the %s copy of %s%s (%d bytes, node budget)", self.node_id,
                     victim.step, victim.kind, victim.namespace, f" from {victim.origin}" if victim.origin else "",
                     victim.nbytes)

    # -- status -----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        held = self.store.everything()
        own: dict[str, list[int]] = {}
        replicas: dict[str, dict[str, list[int]]] = {}
        for h in held:
            if h.kind == "own":
                own.setdefault(h.namespace, []).append(h.step)
            elif h.kind == "replica":
                replicas.setdefault(h.origin, {}).setdefault(h.namespace, []).append(h.step)
        return {
            "node": self.node_id, "address": f"{self.address[0]}:{self.address[1]}",
            "memory_dir": self.config.memory_dir,
            "peers": {f"{a[0]}:{a[1]}": n for a, n in self.peer_ids.items()},
            "ring_targets": [n for n, _ in self.targets()],
            "namespaces": {ns: {"steps": sorted(s), "replicated": self._replicated_view(ns),
                                "drain": self.drain_lag.get(ns, {})} for ns, s in own.items()},
            "replicas_held": replicas,
            "protected": {ns: sorted(s) for ns, s in self.protected.items() if s},
            "budget_bytes": self.config.budget_bytes, "used_bytes": self.store.usage_bytes(),
            "held_bytes": {k: sum(h.nbytes for h in held if h.kind == k) for k in ("own", "replica", "cache")},
            "replication_lag_s": self.metrics.replication_lag_seconds.value(),
            "last_replication": self.last_replication,
            "last_fetch": self.last_fetch,
            "last_prefetch": self.last_prefetch,
            "load_waits": self.load_waits.view(),
            "evictions": {k: self.metrics.evictions.value(kind=k) for k in ("cache", "replica")},
            "drain": self.drain_state,
        }

    def _replicated_view(self, ns: str) -> dict[str, Any]:
        done = self.replicated.get(ns)
        return {} if done is None else {"step": done[0], "to": sorted(done[2])}

    def _update_gauges(self) -> None:
        for kind in ("own", "replica", "cache"):
            self.metrics.held_bytes.set(0, kind=kind)
        for h in self.store.everything():
            self.metrics.held_bytes.inc(h.nbytes, kind=h.kind)
        lag, oldest = 0, 0.0
        now = time.time()
        for ns in self.store.namespaces():
            steps = self.store.own(ns).list_steps()
            done = self.replicated.get(ns)
            if steps and self.config.replicas > 0 and (done is None or done[0] != steps[-1].step or not done[2]):
                lag += 1
                marker = self.store.own(ns).step_dir(steps[-1].step) / layout.MARKER
                try:
                    oldest = max(oldest, now - marker.stat().st_mtime)
                except FileNotFoundError:
                    pass
        self.metrics.replication_lag.set(lag)
        self.metrics.replication_lag_seconds.set(round(oldest, 3))

    def restoring(self) -> bool:
        """A prefetch is in flight: puts are refused meanwhile (the sender retries next round)."""
        with self._lock:
            return self._prefetches > 0

    def count_prefetch(self, delta: int) -> None:
        with self._lock:
            self._prefetches += delta

    def fetch_lock(self, key: tuple[str, int, str]) -> threading.Lock:
        with self._lock:
            return self._fetch_locks.setdefault(key, threading.Lock())


def _owner_token(memory_dir: str) -> str:
    """This node's owner token (``<root>/.agent-owner``, 0600), made on first start."""
    with safefs.open_dir(memory_dir, []) as dfd:
        try:
            return safefs.read_small(dfd, OWNER_FILE, 128).decode().strip()
        except FileNotFoundError:
            pass
        token = secrets.token_hex(32)
        fd = safefs.open_file(dfd, OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            os.write(fd, token.encode())
        finally:
            os.close(fd)
        return token
