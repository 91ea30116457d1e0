"""``NodeState``: what one node's agent knows and holds, shared by its request handlers.

The store, the config, the metrics, the peers (their node ids, the ones down), what was
replicated where, the holders a load may fetch from, the puts in flight and the bytes they
reserved, the protected steps, the owner token, and one lock over them. The handlers
(``serve``, ``receive``, ``replicate``, ``protect``, ``prefetch``, ``drain``, ``local``) take a
``NodeState`` and use its public methods only; ``service.Agent`` owns one and drives it (the
loop, the listeners). Nothing here imports a handler.

Call order for a replica (``receive``): ``begin_put`` → ``reserve`` → ``settle`` once the bytes
are staged → ``release`` → ``end_put``. The budget: ``enforce_budget`` each round and for a
``make_room``; ``evict`` deletes one copy and counts it.
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
from tierckpt.agent import safefs
from tierckpt.agent.client import PeerClient
from tierckpt.agent.config import AgentConfig
from tierckpt.agent.metrics import AgentMetrics, LoadWaits
from tierckpt.agent.store import Held, NodeStore, select_evictions
from tierckpt.observability import get_logger

__all__ = ["Holder", "NodeState", "ring_targets"]

_log = get_logger("agent")
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


class NodeState:
    """One node's agent state; ``secret`` authenticates this node's connections to peers."""

    def __init__(self, config: AgentConfig, secret: bytes) -> None:
        self.config = config
        self.secret = secret
        self.store = NodeStore(config.memory_dir, config.node_id)
        self.metrics = AgentMetrics()
        self.address: tuple[str, int] = config.listen  # the bound address, once the peer listener has one
        self.peer_ids: dict[tuple[str, int], str] = {}
        self.peers_down: set[tuple[str, int]] = set()  # peers that did not answer the last refresh
        self.replicated: dict[str, tuple[int, str, frozenset[str]]] = {}  # ns → (step, save id, nodes)
        self._holders: dict[tuple[str, int], list[Holder]] = {}
        self._fetch_locks: dict[tuple[str, int, str], threading.Lock] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.drain_state: dict[str, Any] = {}
        self.drain_lag: dict[str, dict[str, Any]] = {}
        self._drain_listed = float("-inf")
        self.last_replication: dict[str, Any] = {}
        self.last_fetch: dict[str, Any] = {}
        self.last_prefetch: dict[str, Any] = {}  # agent.prefetch: the last prefetch on join
        self._prefetches = 0  # prefetches in flight: replicas sent here wait until they end
        self.load_waits = LoadWaits()  # per step: how long loads' fetch requests waited (agent.prefetch)
        self._reserved = 0
        self._puts: set[tuple[str, str, int]] = set()
        self.protect_lock = threading.Lock()
        self.protected: dict[str, set[int]] = {}  # own namespace → the steps its .keep lists (agent.protect)
        Path(config.memory_dir).mkdir(parents=True, exist_ok=True)
        self.owner_token = _owner_token(config.memory_dir)
        self.store.gc()

    @property
    def node_id(self) -> str:
        return self.config.node_id

    # -- the loop's wake-up ---------------------------------------------------------------
    def wake(self) -> None:
        """Run the agent's next round now (a commit notice, new peers)."""
        self._wake.set()

    def wait_for_round(self, timeout: float) -> None:
        """Until ``wake`` or ``timeout`` seconds, whichever comes first (the agent's loop)."""
        self._wake.wait(timeout)
        self._wake.clear()

    # -- peers ------------------------------------------------------------------------------
    def connect(self, address: tuple[str, int], timeout: float = 30.0) -> PeerClient:
        """An authenticated connection to the agent at ``address``, on this agent's wire."""
        return PeerClient.connect(address, self.node_id, self.secret, timeout=timeout,
                                  insecure=self.config.insecure_wire)

    def replace_peers(self, peers: tuple[tuple[str, int], ...]) -> bool:
        """Ask ``peers`` from now on; False if they are the ones asked already."""
        with self._lock:
            if peers == self.config.peers:
                return False
            self.config = replace(self.config, peers=peers)
            self.peers_down &= set(peers)
            return True

    def record_peers(self, asked: Sequence[tuple[str, int]], found: dict[tuple[str, int], str]) -> None:
        """A peer refresh's answers: the node id of each peer that answered; the others are down."""
        with self._lock:
            self.peer_ids = {addr: found[addr] for addr in asked if addr in found}
            # a load's catalog skips these until a refresh finds them again (a lost host would
            # otherwise cost every load the whole deadline)
            self.peers_down = {addr for addr in asked if addr not in found}

    def peers_up(self) -> list[tuple[str, int]]:
        """The peers to ask: those that did not fail the last refresh (every 5 s)."""
        with self._lock:
            return [a for a in self.config.peers if a not in self.peers_down]

    def targets(self) -> list[tuple[str, tuple[str, int]]]:
        by_node = {node: addr for addr, node in self.peer_ids.items() if node != self.node_id}
        return [(n, by_node[n]) for n in ring_targets(list(by_node), self.node_id, self.config.replicas)]

    # -- replication ----------------------------------------------------------------------
    def replicated_to(self, ns: str, step: int, save_id: str) -> frozenset[str]:
        """The nodes that hold this save of ``ns``'s step as a replica sent from here."""
        with self._lock:
            done = self.replicated.get(ns)
        return done[2] if done and done[:2] == (step, save_id) else frozenset()

    def record_replicated(self, ns: str, step: int, save_id: str, node: str) -> None:
        with self._lock:
            done = self.replicated.get(ns)
            have = done[2] if done and done[:2] == (step, save_id) else frozenset()
            self.replicated[ns] = (step, save_id, have | {node})

    def replicated_steps(self) -> dict[str, int]:
        """Own namespace → the step replicated to at least one target."""
        with self._lock:
            return {ns: done[0] for ns, done in self.replicated.items() if done[2]}

    # -- holders (loads) ------------------------------------------------------------------
    def record_holders(self, ns: str, keyed: Sequence[tuple[int, Holder]]) -> None:
        """Every holder of ``ns`` found now, per step; those recorded before for ``ns`` go."""
        with self._lock:
            for key in [k for k in self._holders if k[0] == ns]:
                del self._holders[key]
            for step, h in keyed:
                self._holders.setdefault((ns, step), []).append(h)

    def holders_of(self, ns: str, step: int) -> list[Holder]:
        with self._lock:
            return list(self._holders.get((ns, step), []))

    def steps_held(self, ns: str) -> list[tuple[int, list[Holder]]]:
        """(step, its holders) of ``ns`` as last recorded."""
        with self._lock:
            return [(k[1], list(v)) for k, v in self._holders.items() if k[0] == ns]

    def fetch_lock(self, key: tuple[str, int, str]) -> threading.Lock:
        with self._lock:
            return self._fetch_locks.setdefault(key, threading.Lock())

    # -- puts -------------------------------------------------------------------------------
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

    def puts_in_flight(self) -> set[tuple[str, str, int]]:
        """(origin, namespace, step) of every put in flight."""
        with self._lock:
            return set(self._puts)

    def restoring(self) -> bool:
        """A prefetch is in flight: puts are refused meanwhile (the sender retries next round)."""
        with self._lock:
            return self._prefetches > 0

    def count_prefetch(self, delta: int) -> None:
        with self._lock:
            self._prefetches += delta

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

    def reserved_bytes(self) -> int:
        """Bytes reserved by puts in flight."""
        with self._lock:
            return self._reserved

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

    # -- drain lag --------------------------------------------------------------------------
    def drain_due(self, interval_s: float) -> bool:
        """The durable tier was last listed more than ``interval_s`` seconds ago."""
        return time.monotonic() - self._drain_listed > interval_s

    def drain_listed(self) -> None:
        """The durable tier is being listed now (``drain_due`` counts from here)."""
        self._drain_listed = time.monotonic()

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

    def update_gauges(self) -> None:
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
