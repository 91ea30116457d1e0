"""What one node's memory root holds, as the agent sees it: own steps, replicas, the peer cache.

    <memory root>/<namespace>/step_<N>/                       own steps (written by trainers)
    <memory root>/.replicas/<origin node>/<namespace>/step_<N>/  replicas of other nodes' files
    <memory root>/.peer/<namespace>/step_<N>/                 files fetched for a load

Replicas use the same commit protocol as every local tier (staging directory, marker last,
one rename), so a replica whose transfer died is never visible. ``select_evictions`` is the
node budget's pure policy.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tierckpt import layout
from tierckpt.config import validate_namespace
from tierckpt.errors import ConfigError, TierckptError
from tierckpt.integrity import sealed_manifest
from tierckpt.tiers.local import LocalTier

__all__ = ["Held", "NodeStore", "select_evictions"]


@dataclass(frozen=True)
class Held:
    """One committed step copy on this node: ``kind`` is 'own', 'replica' or 'cache'."""

    kind: str
    namespace: str
    origin: str
    step: int
    nbytes: int
    mtime: float
    newest: bool = False  # the newest of its (kind, origin, namespace)
    save_id: str = ""
    held: dict[str, int] = field(default_factory=dict)
    all_files: tuple[str, ...] = ()


def select_evictions(entries: Sequence[Held], need_bytes: int, kinds: Collection[str] = ("cache", "replica", "own")
                     ) -> list[Held]:
    """Copies to delete, in order, until ``need_bytes`` are freed (all candidates if they do not suffice).

    Order: peer-cache copies, then own steps that are not their namespace's newest, then
    replicas that are not their origin's newest, then the newest replicas (oldest first within
    each group): a replica goes after its holder's own older steps. The newest own step of
    each namespace is never selected. ``kinds`` limits the candidates: the agent itself passes
    ('cache', 'replica'), because deleting an own step frees a slot for its trainer's next save
    but no memory (slots are reused, not freed).
    """
    def rank(h: Held) -> tuple[int, float]:
        group = {"cache": 0, "own": 1, "replica": 2 if not h.newest else 3}[h.kind]
        return group, h.mtime

    chosen: list[Held] = []
    freed = 0
    for h in sorted((h for h in entries if h.kind in kinds and not (h.kind == "own" and h.newest)), key=rank):
        if freed >= need_bytes:
            break
        chosen.append(h)
        freed += h.nbytes
    return chosen


def _valid_ns(name: str) -> bool:
    try:
        validate_namespace(name)
    except ConfigError:
        return False
    return True


class NodeStore:
    """Views of one memory root; every method is safe against concurrent trainers."""

    def __init__(self, memory_dir: str, node_id: str) -> None:
        self.root = Path(memory_dir)
        self.node_id = node_id

    def own(self, namespace: str) -> LocalTier:
        return LocalTier(self.root, namespace, name="memory", durable=False)

    def replica(self, origin: str, namespace: str) -> LocalTier:
        return LocalTier(self.root / layout.REPLICAS / origin, namespace, name="replica", durable=False)

    def cache(self, namespace: str) -> LocalTier:
        return LocalTier(self.root / layout.PEER_CACHE, namespace, name="peer", durable=False)

    def tier_for(self, origin: str, namespace: str) -> LocalTier:
        return self.own(namespace) if origin == self.node_id else self.replica(origin, namespace)

    # -- listing ------------------------------------------------------------------
    def namespaces(self) -> list[str]:
        return sorted(n for n in _listdir(self.root) if _valid_ns(n) and (self.root / n).is_dir())

    def origins(self) -> list[str]:
        return sorted(n for n in _listdir(self.root / layout.REPLICAS) if _valid_ns(n))

    def replica_namespaces(self, origin: str) -> list[str]:
        return sorted(n for n in _listdir(self.root / layout.REPLICAS / origin) if _valid_ns(n))

    def holdings(self, namespace: str, *, with_manifest: bool = True) -> list[Held]:
        """Committed own steps and replicas of ``namespace`` on this node."""
        out = self._tier_holdings("own", self.node_id, self.own(namespace), namespace, with_manifest)
        for origin in self.origins():
            out += self._tier_holdings("replica", origin, self.replica(origin, namespace), namespace, with_manifest)
        return out

    def everything(self) -> list[Held]:
        """Every copy on the node (for the budget and ``status``), manifests not read."""
        out: list[Held] = []
        for ns in self.namespaces():
            out += self._tier_holdings("own", self.node_id, self.own(ns), ns, False)
        for origin in self.origins():
            for ns in self.replica_namespaces(origin):
                out += self._tier_holdings("replica", origin, self.replica(origin, ns), ns, False)
        for ns in (n for n in _listdir(self.root / layout.PEER_CACHE) if _valid_ns(n)):
            tier = self.cache(ns)
            for s in tier.list_steps(include_uncommitted=True):
                out.append(Held("cache", ns, "", s.step, sum(s.files.values()), _mtime(tier.step_dir(s.step))))
        return out

    def _tier_holdings(self, kind: str, origin: str, tier: LocalTier, ns: str, with_manifest: bool) -> list[Held]:
        try:
            listings = tier.list_steps()
        except TierckptError:
            return []
        out = []
        for i, s in enumerate(listings):
            save_id, names = "", tuple(s.files)
            if with_manifest:
                try:
                    mf = sealed_manifest(tier, s.step, ns)
                except TierckptError:
                    continue  # a damaged copy is not offered to anyone
                save_id, names = mf.save_id, tuple(sorted(mf.files))
            out.append(Held(kind, ns, origin, s.step, sum(s.files.values()), _mtime(tier.step_dir(s.step) / layout.MARKER),
                            newest=i == len(listings) - 1, save_id=save_id, held=dict(s.files), all_files=names))
        return out

    def usage_bytes(self) -> int:
        """Bytes of every file under the memory root, each inode counted once (slots included)."""
        seen: set[tuple[int, int]] = set()
        total = 0
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
        return total

    def delete(self, h: Held) -> None:
        if h.kind == "cache":
            shutil.rmtree(self.cache(h.namespace).step_dir(h.step), ignore_errors=True)
        else:
            self.tier_for(h.origin, h.namespace).delete(h.step)

    def gc(self) -> None:
        """Remove replica transfers and fetches that died (their staging directories)."""
        for origin in self.origins():
            for ns in self.replica_namespaces(origin):
                self.replica(origin, ns).gc_staging()
        for ns in (n for n in _listdir(self.root / layout.PEER_CACHE) if _valid_ns(n)):
            shutil.rmtree(self.root / layout.PEER_CACHE / ns / layout.STAGING, ignore_errors=True)


def _listdir(path: Path) -> Iterable[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
