"""The sender side of replication: each namespace's newest own step to its ring targets, one
thread per (namespace, target), so a slow or stuck target delays only its own copy.

Call order (the agent's loop, each round): ``Replicator.round(wait_s)`` starts a send for
every target that lacks the newest step and has none in flight, then waits at most
``wait_s`` for them (a send that takes longer goes on in its thread; the next round skips
that target until it ends). Each send pins its data files (hard links: the trainer cannot
reuse the slots meanwhile), connects, puts with a deadline proportional to its bytes, and
records the target in ``NodeState.replicated`` when the peer stored it (or held it already).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tierckpt import layout
from tierckpt.agent import protocol as p
from tierckpt.agent.client import PeerError
from tierckpt.agent.protect import refresh as refresh_protected
from tierckpt.errors import TierckptError
from tierckpt.observability import get_logger, throughput
from tierckpt.tiers.local import LocalTier

if TYPE_CHECKING:
    from tierckpt.agent.state import NodeState

__all__ = ["Replicator"]

_log = get_logger("agent")


class Replicator:
    """Replication sends of one agent; ``round`` is called from the agent's loop (or ``tick``)."""

    def __init__(self, state: NodeState) -> None:
        self.state = state
        self._inflight: dict[tuple[str, str], threading.Thread] = {}
        self._lock = threading.Lock()

    def round(self, wait_s: float) -> None:
        for ns in self.state.store.namespaces():
            self._start(ns)
        with self._lock:
            running = list(self._inflight.values())
        end = time.monotonic() + wait_s
        for t in running:  # those of earlier rounds too: a round ends with what finished recorded
            t.join(max(0.0, end - time.monotonic()))

    def now(self, ns: str) -> None:
        """Replicate ``ns``'s newest step to every target that lacks it, and wait (the benchmark times this)."""
        for t in self._start(ns):
            t.join()

    def busy(self) -> int:
        with self._lock:
            return sum(t.is_alive() for t in self._inflight.values())

    def _start(self, ns: str) -> list[threading.Thread]:
        state = self.state
        tier = state.store.own(ns)
        steps = tier.list_steps()
        if not steps:
            return []
        newest = steps[-1]
        try:
            save_id = layout.check_marker(tier.read_file(newest.step, layout.MARKER),
                                          tier.read_file(newest.step, layout.MANIFEST), where=tier.location(newest.step))
        except TierckptError:
            return []  # deleted meanwhile, or damaged: nothing to offer
        have = state.replicated_to(ns, newest.step, save_id)
        out = []
        for node, addr in state.targets():
            with self._lock:
                running = self._inflight.get((ns, node))
                if node in have or (running is not None and running.is_alive()):
                    continue
                t = threading.Thread(target=self._send, args=(ns, newest.step, save_id, [s.step for s in steps], node, addr),
                                     name="tierckpt-agent-send", daemon=True)
                self._inflight[(ns, node)] = t
            t.start()
            out.append(t)
        return out

    def _send(self, ns: str, step: int, save_id: str, keep: list[int], node: str, addr: tuple[str, int]) -> None:
        state = self.state
        tier = state.store.own(ns)
        try:
            names = sorted(n for n in _files(tier, step) if n.endswith(".distcp"))
            small: list[tuple[str, Path | bytes]] = [(n, tier.read_file(step, n))
                                                      for n in (layout.METADATA, layout.MANIFEST, layout.MARKER)]
        except TierckptError:
            return
        raw = {n: src for n, src in small if isinstance(src, bytes)}
        try:
            if layout.check_marker(raw[layout.MARKER], raw[layout.MANIFEST], where=tier.location(step)) != save_id:
                return  # replaced meanwhile: the next round sends the new save
        except TierckptError:
            return
        pins = [(n, tier.pin(step, n)) for n in names]
        try:
            if any(pin is None for _, pin in pins):
                return
            files = small + [(n, pin) for n, pin in pins if pin is not None]
            if self._put(ns, step, save_id, files, keep, node, addr):
                state.record_replicated(ns, step, save_id, node)
                refresh_protected(state)  # this step now stays in this node's memory (agent.protect)
        finally:
            for _, pin in pins:
                if pin is not None:
                    tier.unpin(pin)

    def _put(self, ns: str, step: int, save_id: str, files: list[tuple[str, Path | bytes]], keep: list[int],
             node: str, addr: tuple[str, int]) -> bool:
        state = self.state
        nbytes = sum(src.stat().st_size if isinstance(src, Path) else len(src) for _, src in files)
        t0 = time.perf_counter()
        try:
            client = state.connect(addr, timeout=state.config.limits.handshake_s)
            try:
                client.set_deadline(state.config.limits.bulk_s(nbytes))
                client.put(ns, state.node_id, step, save_id, files, keep, state.owner_token)
            finally:
                client.close()
        except (PeerError, p.ProtocolViolation, OSError) as exc:
            _log.warning("[Agent %s] Step %d: replication of %s to %s failed: %s", state.node_id, step, ns, node, exc)
            state.metrics.replication_failures.inc()
            return False
        dt = time.perf_counter() - t0
        state.metrics.replicated_bytes.inc(nbytes)
        state.metrics.replication_seconds.set(dt)
        state.metrics.replication_throughput.set(nbytes / dt if dt > 0 else 0.0)
        state.last_replication = {"step": step, "namespace": ns, "to": node, "bytes": nbytes, "seconds": round(dt, 4)}
        _log.info("[Agent %s] Step %d: replicated %s to %s in %s", state.node_id, step, ns, node, throughput(nbytes, dt))
        return True


def _files(tier: LocalTier, step: int) -> list[str]:
    for s in tier.list_steps():
        if s.step == step:
            return list(s.files)
    return []
