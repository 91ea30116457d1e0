"""Fetching for loads: who holds which steps (``holders``, ``catalog``) and a verified copy of one file (``fetch``).

Call order: ``catalog(state, ns)`` (or ``holders``) records every holder of ``ns``'s steps in the
``NodeState``; ``fetch(state, ns, step, name)`` then takes the sealed manifest first and the file
from the first holder that has it (ranged gets over several connections for a large one), into
``<memory root>/.peer/``. The local socket's ``catalog`` and ``fetch`` (``local``) and the
prefetch on join (``prefetch``) come here.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tierckpt import layout
from tierckpt.agent import protocol as p
from tierckpt.agent import safefs
from tierckpt.agent.client import PeerError, ask_all
from tierckpt.agent.state import Holder, NodeState
from tierckpt.agent.transfer import StreamCheck, split_ranges, verify_file
from tierckpt.errors import IntegrityError, StorageError, TierckptError
from tierckpt.observability import get_logger
from tierckpt.tiers.integrity import sealed_manifest_bytes

__all__ = ["catalog", "fetch", "holders"]

_log = get_logger("agent")


def holders(state: NodeState, ns: str) -> dict[int, set[str]]:
    """Record every copy of ``ns`` this node can fetch from (its own replicas, each reachable
    peer's steps and replicas); return step → every file its manifest lists.

    Peers are asked at once, each within ``limits.peer_deadline_s``: a stuck peer is left
    out of this answer; one that did not answer the agent's last peer refresh is not asked.
    Each entry of a listing is checked on its own; a bad one is dropped, the peer's other
    entries stay.
    """
    keyed: list[tuple[int, Holder]] = []
    all_files: dict[int, set[str]] = {}
    for mine in state.store.holdings(ns):
        all_files.setdefault(mine.step, set()).update(mine.all_files)
        if mine.kind == "replica":
            keyed.append((mine.step, Holder(state.node_id, None, mine.origin, mine.save_id, mine.held)))
    deadline = state.config.limits.peer_deadline_s

    def listing(addr: tuple[str, int]) -> tuple[str, list[p.ListingEntry]]:
        client = state.connect(addr, timeout=deadline)
        try:
            client.set_deadline(deadline)
            entries, dropped = client.list_entries(ns)
        finally:
            client.close()
        if dropped:
            _log.warning("[Agent %s] dropped %d invalid listing entries from %s", state.node_id, dropped, client.node)
        return client.node, entries

    peers = state.peers_up()  # peers that did not answer the last refresh (every 5 s) are skipped until one does
    for addr, (node, entries) in ask_all(peers, listing, deadline).items():
        for e in entries:
            keyed.append((e.step, Holder(node, addr, e.origin, e.save_id, e.held)))
            all_files.setdefault(e.step, set()).update(e.all_files)
    state.record_holders(ns, keyed)
    return all_files


def catalog(state: NodeState, ns: str) -> dict[str, Any]:
    all_files = holders(state, ns)
    items = state.steps_held(ns)
    steps = []
    for step, hs in sorted(items):
        held: dict[str, int] = {}
        for h in hs:
            held.update(h.held)
        steps.append({"step": step, "held": held, "all": sorted(all_files.get(step, set()))})
    return {"ok": True, "steps": steps}


def fetch(state: NodeState, ns: str, step: int, name: str) -> dict[str, Any]:
    """Place a verified copy of one file in the peer cache, trying each holder in turn.

    The sealed manifest comes first (from the cache when a holder still offers that save);
    a data file is then streamed from a holder into a staging file with every item checked
    on the way (one pass), and renamed into the cache only when all of it is good.
    """
    known = state.holders_of(ns, step)
    if not known:
        holders(state, ns)
        known = state.holders_of(ns, step)
    cache = state.store.cache(ns)
    step_dir = cache.step_dir(step)
    errors: list[str] = []
    with state.fetch_lock((ns, step, ".seal")):  # not a file name: no clash with the caller's lock
        manifest = _manifest(state, ns, step, known, errors)  # the seal first: it decides what is good
    if manifest is None:
        return p.reply_error(f"no peer holds a sealed manifest of step {step}: {'; '.join(errors)}", "missing")
    if name in (layout.MANIFEST, layout.MARKER):
        return {"ok": True}
    if (step_dir / name).exists():
        return {"ok": True, "cached": True}  # fetched and verified earlier for this save
    known.sort(key=lambda h: h.save_id != manifest.save_id)  # copies of the same save first
    candidates = [h for h in known if name in h.held]
    if not candidates:
        return p.reply_error(f"no peer holds {name} of step {step}", "missing")
    bad = False
    for h in candidates:
        tmp = step_dir.parent / layout.STAGING / f"{step}.{name}.{uuid.uuid4().hex[:8]}"
        _mkdirs(state, tmp.parent)
        try:
            t0 = time.perf_counter()
            _get_verified(state, h, ns, step, name, tmp, manifest)
            _mkdirs(state, step_dir)
            os.replace(tmp, step_dir / name)
            seconds = time.perf_counter() - t0
            nbytes = (step_dir / name).stat().st_size
            state.metrics.fetched_bytes.inc(nbytes)
            state.metrics.fetch_seconds.inc(seconds)
            if name not in p.SMALL_FILES:  # the data files are what a restore waits for
                state.last_fetch = {"namespace": ns, "step": step, "name": name, "from": h.node, "bytes": nbytes,
                                    "seconds": round(seconds, 4)}
            return {"ok": True, "holder": h.node, "origin": h.origin, "seconds": seconds}
        except IntegrityError as exc:
            bad = True
            errors.append(str(exc))
        except (PeerError, p.ProtocolViolation, OSError, TierckptError) as exc:
            errors.append(f"{h.node}: {exc}")
        finally:
            tmp.unlink(missing_ok=True)
    return p.reply_error("; ".join(errors), "integrity" if bad else "storage")


def _get_verified(state: NodeState, h: Holder, ns: str, step: int, name: str, dest: Path,
                  manifest: layout.Manifest) -> None:
    """One file from ``h`` into ``dest``, verified against ``manifest``; IntegrityError if not."""
    where = f"{name} of step {step} from {h.node}"
    if h.address is None or name == layout.METADATA:
        _get(state, h, ns, step, name, dest)
        _check(dest, name, manifest, where)
        return
    size = manifest.files.get(name)
    if size is None:
        raise IntegrityError(f"{where}: not listed in the manifest")
    check = StreamCheck.for_file(manifest, name, size, where)
    if check is not None and state.config.fetch_streams > 1 and size >= 2 * state.config.fetch_part_bytes:
        _get_parallel(state, h, ns, step, name, dest, size, check.records, where)
        return
    client = state.connect(h.address)
    try:
        client.set_deadline(state.config.limits.bulk_s(size))
        client.get_into(ns, h.origin, step, name, dest, expect_size=size, check=check)
    finally:
        client.close()
    if check is None:
        _check(dest, name, manifest, where)


def _get_parallel(state: NodeState, h: Holder, ns: str, step: int, name: str, dest: Path, size: int,
                  records: list[layout.ItemRecord], where: str) -> None:
    """Parts of one file over ``fetch_streams`` connections at once, each part's items checked on the way.

    One TCP stream is bound by one core on each side; a node's NICs are not. Parts are cut
    at item boundaries so each connection checks whole items while they arrive.
    """
    parts = split_ranges(records, size, state.config.fetch_streams, state.config.fetch_part_bytes)
    if h.address is None:
        raise StorageError(f"{where}: a parallel fetch needs a remote holder")
    address = h.address
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)

        def one(part: tuple[int, int, list[layout.ItemRecord]]) -> None:
            offset, length, recs = part
            client = state.connect(address)
            try:
                client.set_deadline(state.config.limits.bulk_s(length))
                client.get_range_into(ns, h.origin, step, name, fd, offset, length,
                                      StreamCheck(recs, where, start=offset))
            finally:
                client.close()

        with ThreadPoolExecutor(len(parts), thread_name_prefix="tierckpt-agent-fetch") as pool:
            for future in [pool.submit(one, part) for part in parts]:
                future.result()  # the first failure, after every part stopped
    finally:
        os.close(fd)


def _get(state: NodeState, h: Holder, ns: str, step: int, name: str, dest: Path) -> None:
    if h.address is None:  # a replica on this node: copied from it, no link followed
        store = state.store
        with safefs.open_dir(store.root, [*store.parts("replica", h.origin, ns), layout.step_dir_name(step)]) as sfd:
            src = safefs.open_file(sfd, name)
        try:
            out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                size, done = os.fstat(src).st_size, 0
                while done < size:
                    n = os.sendfile(out, src, done, size - done)
                    if n == 0:
                        raise OSError(f"{name} ended early")
                    done += n
            finally:
                os.close(out)
        finally:
            os.close(src)
        return
    client = state.connect(h.address)
    try:
        client.get_into(ns, h.origin, step, name, dest, max_size=p.MAX_SMALL if name in p.SMALL_FILES else p.MAX_FILE)
    finally:
        client.close()


def _manifest(state: NodeState, ns: str, step: int, known: list[Holder], errors: list[str]) -> layout.Manifest | None:
    """The step's sealed manifest: the cached one while a holder offers that save, else from the first holder."""
    cache_dir = state.store.cache(ns).step_dir(step)
    cached = _cached_manifest(cache_dir, ns, step)
    if cached is not None and any(h.save_id == cached.save_id for h in known):
        return cached
    for h in [h for h in known if layout.MANIFEST in h.held and layout.MARKER in h.held]:
        tmp = cache_dir.parent / layout.STAGING / f"{step}.mf.{uuid.uuid4().hex[:8]}"
        _mkdirs(state, tmp)
        try:
            _get(state, h, ns, step, layout.MANIFEST, tmp / layout.MANIFEST)
            _get(state, h, ns, step, layout.MARKER, tmp / layout.MARKER)
            mf = _sealed(tmp, ns, step, f"step {step} on {h.node}")
            if cached is None or cached.save_id != mf.save_id:
                shutil.rmtree(cache_dir, ignore_errors=True)  # files of another save of this step
            _mkdirs(state, cache_dir)
            for n in (layout.MANIFEST, layout.MARKER):
                os.replace(tmp / n, cache_dir / n)
            return mf
        except (PeerError, p.ProtocolViolation, OSError, TierckptError) as exc:
            errors.append(f"{h.node}: {exc}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return None


def _sealed(directory: Path, ns: str, step: int, where: str) -> layout.Manifest:
    return sealed_manifest_bytes((directory / layout.MARKER).read_bytes(), (directory / layout.MANIFEST).read_bytes(),
                                 ns, step, where=where)


def _cached_manifest(cache_dir: Path, ns: str, step: int) -> layout.Manifest | None:
    try:
        return _sealed(cache_dir, ns, step, f"cached step {step}")
    except (OSError, TierckptError):
        return None


def _check(path: Path, name: str, manifest: layout.Manifest, where: str) -> None:
    if name == layout.METADATA:
        if layout.checksum(path.read_bytes()) != manifest.metadata_xxh3:
            raise IntegrityError(f"{where}: fails its checksum")
        return
    size = manifest.files.get(name)
    if size is None or path.stat().st_size != size:
        raise IntegrityError(f"{where}: not {size} bytes as the manifest says")
    verify_file(path, [r for r in manifest.items if r.file == name], where)


def _mkdirs(state: NodeState, path: Path) -> None:
    """``path`` under the memory root, each missing directory made 0700, no link followed."""
    with safefs.open_dir(state.store.root, path.relative_to(state.store.root).parts, create=True):
        pass
