"""What one node's memory root holds, as the agent sees it: own steps, replicas, the peer cache.

    <memory root>/<namespace>/step_<N>/                       own steps (written by trainers)
    <memory root>/.replicas/<origin node>/<namespace>/step_<N>/  replicas of other nodes' files
    <memory root>/.peer/<namespace>/step_<N>/                 files fetched for a load

Replicas use the same commit protocol as every local tier (staging directory, marker last,
one rename), so a replica whose transfer died is never visible. ``select_evictions`` is the
node budget's pure policy. Nothing here follows a symbolic link: a step, file or directory
that is one is not listed, read or served, and deletions remove the link, not its target
(``safefs``). Each replica step records the hash of its sender's owner token
(``.owners/step_<N>``): only a sender holding that token may replace or delete it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tierckpt import layout
from tierckpt.agent import protocol as p
from tierckpt.agent import safefs
from tierckpt.config import validate_namespace
from tierckpt.errors import ConfigError, IntegrityError, TierckptError
from tierckpt.node.budget import node_usage_bytes
from tierckpt.tiers.integrity import sealed_manifest_bytes
from tierckpt.tiers.local import LocalTier

__all__ = ["OWNERS", "QUARANTINE", "Held", "NodeStore", "owner_hash", "select_evictions"]

OWNERS = ".owners"  # beside a namespace's replica steps: the owner-token hash of each
QUARANTINE = ".quarantine"  # replicas that failed a check when served


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

    def parts(self, kind: str, origin: str, namespace: str) -> list[str]:
        """The path of a tier's namespace directory under the root, as components (for ``safefs``)."""
        if kind == "own":
            return [namespace]
        if kind == "replica":
            return [layout.REPLICAS, origin, namespace]
        return [layout.PEER_CACHE, namespace]

    def kind_of(self, origin: str) -> str:
        return "own" if origin == self.node_id else "replica"

    def sealed(self, kind: str, origin: str, ns: str, step: int) -> tuple[layout.Manifest, bytes]:
        """A committed copy's sealed manifest and marker, read without following links; names
        in the manifest validated. IntegrityError (or OSError) when the copy is not good."""
        where = f"{'/'.join(self.parts(kind, origin, ns))}/{layout.step_dir_name(step)}"
        with safefs.open_dir(self.root, [*self.parts(kind, origin, ns), layout.step_dir_name(step)]) as dfd:
            marker = safefs.read_small(dfd, layout.MARKER, p.MAX_SMALL)
            raw = safefs.read_small(dfd, layout.MANIFEST, p.MAX_SMALL)
        mf = sealed_manifest_bytes(marker, raw, ns, step, where=where)
        try:
            for name in mf.files:
                p.validate_file_name(name)
        except p.ProtocolViolation as exc:
            raise IntegrityError(f"{where}: {exc}") from None
        return mf, marker

    # -- owners of replicas ---------------------------------------------------------
    def owner_of(self, origin: str, ns: str, step: int) -> str | None:
        """The owner-token hash recorded for a replica step (None: none recorded)."""
        try:
            with safefs.open_dir(self.root, [*self.parts("replica", origin, ns), OWNERS]) as dfd:
                return safefs.read_small(dfd, layout.step_dir_name(step), 128).decode()
        except (OSError, UnicodeDecodeError):
            return None

    def set_owner(self, origin: str, ns: str, step: int, token: str) -> None:
        with safefs.open_dir(self.root, [*self.parts("replica", origin, ns), OWNERS], create=True) as dfd:
            tmp = layout.temp_name(layout.step_dir_name(step))
            fd = safefs.open_file(dfd, tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                os.write(fd, owner_hash(token).encode())
            finally:
                os.close(fd)
            os.rename(tmp, layout.step_dir_name(step), src_dir_fd=dfd, dst_dir_fd=dfd)

    # -- listing ------------------------------------------------------------------
    def namespaces(self) -> list[str]:
        return sorted(n for n in _listdir(self.root) if _valid_ns(n) and _real_dir(self.root / n))

    def origins(self) -> list[str]:
        if not _real_dir(self.root / layout.REPLICAS):
            return []
        return sorted(n for n in _listdir(self.root / layout.REPLICAS)
                      if _valid_ns(n) and _real_dir(self.root / layout.REPLICAS / n))

    def replica_namespaces(self, origin: str) -> list[str]:
        base = self.root / layout.REPLICAS / origin
        return sorted(n for n in _listdir(base) if _valid_ns(n) and _real_dir(base / n))

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
        if not all(_real_dir(self.root.joinpath(*self.parts(kind, origin, ns)[:i + 1]))
                   for i in range(len(self.parts(kind, origin, ns)))):
            return []  # a link where a directory of the root should be: nothing there is ours
        try:
            listings = [s for s in tier.list_steps() if _plain_step(tier.step_dir(s.step), s.files)]
        except TierckptError:
            return []
        out = []
        for i, s in enumerate(listings):
            save_id, names = "", tuple(s.files)
            if with_manifest:
                try:
                    mf, _ = self.sealed(kind, origin, ns, s.step)
                except (TierckptError, OSError):
                    continue  # a damaged copy is not offered to anyone
                save_id, names = mf.save_id, tuple(sorted(mf.files))
            out.append(Held(kind, ns, origin, s.step, sum(s.files.values()), _mtime(tier.step_dir(s.step) / layout.MARKER),
                            newest=i == len(listings) - 1, save_id=save_id, held=dict(s.files), all_files=names))
        return out

    def usage_bytes(self) -> int:
        """Bytes of every file under the memory root, each inode counted once (slots included)."""
        return node_usage_bytes(self.root)

    def delete(self, h: Held) -> None:
        """Remove a copy (the marker first, so it stops counting at once); links are not followed."""
        kind = "replica" if h.kind == "replica" else h.kind
        try:
            with safefs.open_dir(self.root, self.parts(kind, h.origin, h.namespace)) as dfd:
                name = layout.step_dir_name(h.step)
                if h.kind != "cache":
                    try:
                        with safefs.open_dir(self.root, [*self.parts(kind, h.origin, h.namespace), name]) as sfd:
                            os.unlink(layout.MARKER, dir_fd=sfd)
                    except (FileNotFoundError, safefs.NotInRoot):
                        pass
                safefs.remove_entry(dfd, name)
            if h.kind == "replica":
                with safefs.open_dir(self.root, [*self.parts(kind, h.origin, h.namespace), OWNERS]) as ofd:
                    safefs.remove_entry(ofd, name)
        except (FileNotFoundError, safefs.NotInRoot):
            pass

    def quarantine(self, origin: str, ns: str, step: int) -> None:
        """Move a replica that failed its checks out of sight (``.quarantine``, removed at the next start)."""
        try:
            with safefs.open_dir(self.root, self.parts("replica", origin, ns)) as dfd:
                _mkdir_at(dfd, QUARANTINE)
                os.rename(layout.step_dir_name(step), f"{QUARANTINE}/{layout.step_dir_name(step)}.{os.urandom(4).hex()}",
                          src_dir_fd=dfd, dst_dir_fd=dfd)
        except (FileNotFoundError, safefs.NotInRoot):
            pass

    def gc(self) -> None:
        """Remove replica transfers and fetches that died (their staging directories)."""
        for origin in self.origins():
            for ns in self.replica_namespaces(origin):
                self.replica(origin, ns).gc_staging()
                with safefs.open_dir(self.root, self.parts("replica", origin, ns)) as dfd:
                    safefs.remove_entry(dfd, QUARANTINE)
        for ns in (n for n in _listdir(self.root / layout.PEER_CACHE) if _valid_ns(n)):
            shutil.rmtree(self.root / layout.PEER_CACHE / ns / layout.STAGING, ignore_errors=True)


def owner_hash(token: str) -> str:
    return hashlib.sha256(b"tierckpt-owner:" + token.encode()).hexdigest()


def _mkdir_at(dfd: int, name: str) -> None:
    try:
        os.mkdir(name, 0o700, dir_fd=dfd)
    except FileExistsError:
        pass


def _real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _plain_step(step_dir: Path, files: Mapping[str, int]) -> bool:
    """A real directory whose files are all regular files (no link anywhere)."""
    if not _real_dir(step_dir):
        return False
    try:
        return all(stat.S_ISREG(os.lstat(step_dir / n).st_mode) for n in files)
    except OSError:
        return False


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
