"""Prefetch on join: a node that lacks its ranks' newest state pulls it from peers while its workers start.

A replacement host's memory tier is empty; its workers would ask the agent for their files
only when ``Checkpointer.load`` runs, after importing torch, building the model and joining
the process group, so the whole transfer would be visible in the recovery. Instead, as soon
as the launcher knows which ranks this node runs (after its rendezvous), it asks its agent to
prefetch: the agent lists what the peers hold, picks for each of these ranks the newest step
the peers hold completely (``plan``, pure) and fetches those files into the peer cache
(``<memory root>/.peer/``) through the same verified path as a load (``fetch.fetch``: the
sealed manifest first, every item checked while it arrives, one rename when good).

A worker's load then finds the files in the cache, or waits for the one being fetched: each
fetch holds the per-file lock that the worker's own ``fetch`` request takes, and a fetch that
finds the file cached returns at once, so no file is fetched twice. A prefetch that fails
(a peer gone, a bad digest) leaves nothing in the cache (the staging file is removed) and is
reported; the worker's load then takes today's path.

While a prefetch is in flight the agent refuses replicas sent to it (``receive._refusal``:
an error before any bulk byte; the sender retries next round), so the survivors' replication
to the new node does not halve the restore's bandwidth on the same link.

Which namespaces: local mode saves rank ``r`` in ``<ns>--rank<r>`` (every file of the step is
``r``'s: prefetch them all); global mode saves every rank in ``<ns>`` (prefetch ``r``'s data
files ``__<r>_<k>.distcp`` and ``.metadata``). Both are asked; the one the peers hold is fetched.

Call order: ``start(state, namespace, ranks, on_done)`` returns a started ``PrefetchJob`` at
once (one daemon thread) → ``on_done(job)`` from the thread when it ends, then ``job.wait()``
returns.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tierckpt import layout
from tierckpt.agent import fetch
from tierckpt.config import validate_namespace
from tierckpt.errors import ConfigError
from tierckpt.observability import get_logger

if TYPE_CHECKING:
    from tierckpt.agent.state import NodeState

__all__ = ["CatalogStep", "PrefetchJob", "Want", "namespaces_for", "parse_ranks", "plan", "start"]

_log = get_logger("agent")
_DATA_RE = re.compile(r"__([0-9]{1,9})_[0-9]{1,9}\.distcp")
MAX_RANKS = 4096  # ranks one node may ask for (a local request is validated against it)


@dataclass(frozen=True)
class CatalogStep:
    """One step as the peers hold it: files reachable (name → size) and every file its manifest lists."""

    step: int
    held: Mapping[str, int]
    all_files: frozenset[str]


@dataclass(frozen=True)
class Want:
    """What to fetch: ``names`` of ``step`` of ``namespace`` (data files last-listed, small files first)."""

    namespace: str
    step: int
    names: tuple[str, ...]
    nbytes: int


def namespaces_for(namespace: str, ranks: Sequence[int]) -> list[tuple[str, int | None]]:
    """(namespace, rank) pairs to look at: each rank's local-mode namespace, then the global one (rank None)."""
    return [*((f"{namespace}--rank{r}", r) for r in ranks), (namespace, None)]


def plan(namespace: str, catalog: Mapping[int, CatalogStep], *, ranks: Collection[int] | None,
         own_newest: int | None) -> Want | None:
    """The newest step whose wanted files the peers hold completely, or None (nothing to fetch).

    ``ranks`` None: a local-mode namespace, every file of the step is wanted; else (global
    mode) the data files of those ranks; ``.metadata`` too when a peer offers it. A step no newer than
    ``own_newest`` (this node's own memory holds it or a newer one) is not fetched: the
    load reads the node's own copy.
    """
    for step in sorted(catalog, reverse=True):
        if own_newest is not None and step <= own_newest:
            return None
        entry = catalog[step]
        if ranks is None:
            data = {n for n in entry.all_files if _DATA_RE.fullmatch(n)}
        else:
            data = {n for n in entry.all_files if (m := _DATA_RE.fullmatch(n)) and int(m.group(1)) in ranks}
        if not data:
            continue
        names = [layout.METADATA] if layout.METADATA in entry.held else []  # the manifest does not list it
        names += sorted(data)
        if all(n in entry.held for n in names):
            return Want(namespace, step, tuple(names), sum(entry.held[n] for n in names))
    return None


@dataclass
class PrefetchJob:
    """One prefetch in flight or done. ``results`` per namespace: {step, files, bytes, seconds} or {error}."""

    namespace: str
    ranks: tuple[int, ...]
    started: float = field(default_factory=time.time)  # wall clock, comparable with the workers' traces
    finished: float | None = None
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    @property
    def ok(self) -> bool:
        return not any("error" in r for r in self.results.values())

    @property
    def nbytes(self) -> int:
        return sum(int(r.get("bytes", 0)) for r in self.results.values())

    def summary(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "ranks": list(self.ranks), "started": self.started,
                "finished": self.finished, "ok": self.ok, "bytes": self.nbytes,
                "seconds": None if self.finished is None else round(self.finished - self.started, 3),
                "results": self.results}


def parse_ranks(value: object) -> tuple[int, ...]:
    """A local request's ``ranks``: distinct whole numbers >= 0, at most ``MAX_RANKS``; ValueError if not."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_RANKS:
        raise ValueError(f"ranks must be a list of 1 to {MAX_RANKS} ranks")
    for r in value:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < 2**31:
            raise ValueError("each rank must be a whole number >= 0")
    return tuple(dict.fromkeys(value))


def start(state: NodeState, namespace: str, ranks: Sequence[int],
          on_done: Callable[[PrefetchJob], None] | None = None) -> PrefetchJob:
    """Start prefetching ``ranks``' newest state of ``namespace`` in a daemon thread; returns at once."""
    job = PrefetchJob(namespace, tuple(ranks))
    state.last_prefetch = job.summary()
    state.count_prefetch(+1)

    def run() -> None:
        try:
            _run(state, job)
        except Exception as exc:  # reported, never raised into the launcher; the load takes today's path
            job.results["*"] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            state.count_prefetch(-1)
            job.finished = time.time()
            state.last_prefetch = job.summary()
            try:
                if on_done is not None:  # before ``done``: a waiter sees what the callback reported
                    on_done(job)
            except Exception as exc:  # a failing callback must not leave waiters hanging
                _log.warning("[Agent %s] prefetch callback failed: %s", state.node_id, exc)
            finally:
                job.done.set()

    threading.Thread(target=run, name="tierckpt-agent-prefetch", daemon=True).start()
    return job


def _run(state: NodeState, job: PrefetchJob) -> None:

    wants: list[Want] = []
    for ns, rank in namespaces_for(job.namespace, job.ranks):
        try:
            validate_namespace(ns)  # a long namespace's per-rank names may pass 128 characters: skip those
        except ConfigError:
            continue
        reply = fetch.catalog(state, ns)
        catalog = {int(s["step"]): CatalogStep(int(s["step"]), dict(s["held"]), frozenset(s["all"]))
                   for s in reply["steps"]}
        own = [s.step for s in state.store.own(ns).list_steps()]
        want = plan(ns, catalog, ranks=None if rank is not None else job.ranks, own_newest=max(own, default=None))
        if want is not None:
            wants.append(want)
    for want in wants:
        t0 = time.perf_counter()
        errors = []
        for name in want.names:
            with state.fetch_lock((want.namespace, want.step, name)):  # a worker's fetch of it waits here
                reply = fetch.fetch(state, want.namespace, want.step, name)
            if not reply.get("ok"):
                errors.append(f"{name}: {reply.get('error')}")
                break  # the rest would not make the step loadable from here; the load fetches itself
        seconds = time.perf_counter() - t0
        if errors:
            job.results[want.namespace] = {"step": want.step, "error": "; ".join(errors)}
            _log.warning("[Agent %s] Step %d: prefetch of %s failed, the load fetches itself: %s",
                         state.node_id, want.step, want.namespace, "; ".join(errors))
        else:
            job.results[want.namespace] = {"step": want.step, "files": list(want.names), "bytes": want.nbytes,
                                           "seconds": round(seconds, 3)}
            _log.info("[Agent %s] Step %d: prefetched %s (%d bytes) in %.2fs", state.node_id, want.step,
                      want.namespace, want.nbytes, seconds)
