"""``ResumableLoader``: a plain ``torch.utils.data.DataLoader`` whose position is what the loop consumed.

A ``DataLoader`` with workers draws indices and loads batches ahead of the loop (``prefetch_factor``
batches per worker): its sampler's progress is not the training's. ``ResumableLoader`` counts the
batches it hands to the loop and nothing else; its ``state_dict()`` is the position after the last
batch delivered, so a step saved after consuming batch n resumes at batch n + 1, bit for bit.

Call order (the training process, each rank):

    loader = ResumableLoader(dataset, batch_size=32, seed=0, num_workers=4)   # once per process
    loader.start()                    # optional: the workers fork and warm up now, before the group
    state = {"model": ..., "data": tierckpt.data.item(loader)}                 # one item per rank
    start = ck.load(state)            # repositions the loader (load_state_dict) when a step exists
    for batch in loader:              # the rest of the current epoch; the next epoch starts when
        ...                           # an iterator runs out (or: set_epoch(e) before iter)
        ck.save(step, state)          # the position after this batch

An in-process restart (``tierckpt.resilient``) keeps the loader and its worker processes: build it
outside the restarted function; the generation's ``ck.load`` repositions it. A rollback of at most
``replay_batches`` batches (a fault between a save and the next: the usual case) delivers those
batches again from copies kept of them and the workers go on untouched; a longer one makes the
next ``iter(loader)`` reset the workers (``persistent_workers``: their queued batches drained, the
new position's asked for) instead of forking new ones. When a restart interrupted the loader
inside ``next()`` (its worker queues may be mid-message), that ``iter`` builds a new
``DataLoader`` instead: correct, at the cost of new workers.
"""

from __future__ import annotations

import copy
import functools
import os
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from tierckpt.data.order import EpochOrder, ResumableSampler
from tierckpt.errors import ConfigError, LoaderStateMismatchError, ProtocolError

__all__ = ["ResumableLoader"]

KIND = "tierckpt.ResumableLoader"


class _Ahead:
    """Whether loaders are being built ahead of their rank (``tierckpt.data.ahead.build``, in a
    warm standby): a loader built with neither ``rank`` nor ``world_size`` then waits for ``bind``."""

    building = False
    close_fds: tuple[int, ...] = ()  # descriptors of the standby that its loader's workers close


def _close_then(fds: tuple[int, ...], then: Callable[[int], None] | None, worker_id: int) -> None:
    """A worker_init_fn (bound by ``functools.partial``: picklable) that closes ``fds`` (the
    standby's socket to its agent: a worker holding it would hide the standby's end from the
    agent) and then runs the user's."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    if then is not None:
        then(worker_id)


_AHEAD = _Ahead()


def _world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if rank is None and world_size is None and _AHEAD.building:
        return 0, 1  # built ahead by a warm standby: ``bind`` gives the rank at take-over
    if rank is None and world_size is None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    raise ConfigError("ResumableLoader needs rank= and world_size= (both) when it is built before "
                      "init_process_group (e.g. outside tierckpt.resilient's function: pass "
                      "int(os.environ['RANK']) and int(os.environ['WORLD_SIZE'])); with a process group "
                      "leave both unset")


class ResumableLoader:
    """A ``DataLoader`` over ``dataset`` with a ``ResumableSampler``, counting the batches delivered.

    ``seed``, ``shuffle``, ``drop_last``: the epoch order (``EpochOrder``: DistributedSampler's);
    ``rank``/``world_size``: the default process group's unless given; ``drop_last_batch``: the
    ``DataLoader``'s ``drop_last`` (a short last batch); the other arguments are the
    ``DataLoader``'s own. With ``num_workers > 0`` the workers are persistent (kept across
    iterators and repositions). ``replay_batches``: how many of the latest batches are kept as
    copies (tensors cloned: a memcpy of each batch) to serve a rollback that short without
    touching the workers; 0 keeps none. ``generator`` seeds the workers' base seeds: the loader never
    draws from the global torch RNG (a plain ``DataLoader`` does, once per iterator, and so
    changes the training's random stream when a restart creates one more iterator).
    """

    def __init__(self, dataset: Dataset[Any], *, batch_size: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, rank: int | None = None, world_size: int | None = None,
                 num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None,
                 pin_memory: bool = False, drop_last_batch: bool = False, prefetch_factor: int | None = None,
                 worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None, timeout: float = 0.0, replay_batches: int = 1) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not isinstance(replay_batches, int) or isinstance(replay_batches, bool) or replay_batches < 0:
            raise ConfigError(f"replay_batches must be an int >= 0, got {replay_batches!r}")
        r, w = _world(rank, world_size)
        if _AHEAD.building and _AHEAD.close_fds:
            worker_init_fn = functools.partial(_close_then, _AHEAD.close_fds, worker_init_fn)
        self.dataset = dataset
        self.batch_size = batch_size
        self.order = EpochOrder(length=len(dataset), seed=seed, shuffle=shuffle,  # type: ignore[arg-type]
                                drop_last=drop_last)
        self.sampler = ResumableSampler(self.order, rank=r, world_size=w)
        self._options: dict[str, Any] = {
            "num_workers": num_workers, "collate_fn": collate_fn, "pin_memory": pin_memory,
            "drop_last": drop_last_batch, "worker_init_fn": worker_init_fn,
            "multiprocessing_context": multiprocessing_context, "timeout": timeout,
            "persistent_workers": num_workers > 0,
            **({"prefetch_factor": prefetch_factor} if num_workers > 0 and prefetch_factor is not None else {}),
        }
        self._seeds = torch.Generator()
        self._seeds.manual_seed(seed)
        self.bound = not (rank is None and world_size is None and _AHEAD.building)
        self._loader = self._build()
        self._token = 0  # which iterator may deliver: a reposition retires the older ones
        self._interrupted = False  # an exception left the loader inside next(): its queues may be torn
        self.replay_batches = replay_batches
        self._live: Iterator[Any] | None = None  # the DataLoader iterator of the newest delivery, intact
        # copies of the live iterator's latest batches, in order: (taken before it, copy); the last
        # one ends at _live_taken, where the live iterator goes on
        self._history: deque[tuple[int, Any]] = deque(maxlen=replay_batches)
        self._live_taken = 0
        self._pending: list[Any] | None = None  # copies to deliver again before _live goes on
        self.rebuilds = 0  # DataLoaders built after the first (interrupted inside next())

    @property
    def rank(self) -> int:
        return self.sampler.rank

    @property
    def world_size(self) -> int:
        return self.sampler.world_size

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def _build(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.sampler, generator=self._seeds,
                          **self._options)

    def start(self) -> None:
        """Fork the worker processes now and let them warm up (``num_workers > 0``; else nothing).

        Call it before ``init_process_group`` and ``ck.load``: the workers fork while nothing else
        runs (they inherit no socket of the group) and each loads one batch (the current epoch's
        last) while the group forms and the state loads. Those batches are a warm-up: a fresh
        worker's first batch costs several times a warm one's (its queue and shared-memory
        set-up), and this pays it ahead. The first ``iter`` after the load drains them (the
        workers stay) and asks for the batches of the loaded position."""
        workers = self._options["num_workers"]
        if workers == 0:
            return
        s = self.sampler
        epoch, base, taken = s.epoch, s.base, s.taken
        # one batch a worker (the share's last ones): enough to warm each, little for the first iter to drain
        s.taken = max(0, s.share_size - workers * self.batch_size)
        try:
            iter(self._loader)
        finally:
            s.seek(epoch, base=base, taken=taken)
        self._live, self._pending = None, None
        self._token += 1

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its first batch, unless the loader is in it already (a resumed epoch)."""
        if epoch != self.sampler.epoch:
            self._live, self._pending = None, None
        self.sampler.set_epoch(epoch)
        self._token += 1

    def __len__(self) -> int:
        """Batches left in the current epoch."""
        left = len(self.sampler)
        return left // self.batch_size if self._options["drop_last"] else -(-left // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch. Workers start loading at this call, before the first
        ``next``; when the iterator runs out the next epoch starts.

        After a rollback of at most ``replay_batches`` batches (``load_state_dict`` of a position
        this loader delivered from, in the same epoch) the batches are delivered again from copies
        and the workers go on where they were: nothing is drained or loaded again."""
        self._check_bound()
        self._token += 1
        if self._pending is not None and self._live is not None:
            replay, self._pending = self._pending, None
            return self._deliver(self._live, self._token, replay)
        self._start_live()
        return self._deliver(self._live, self._token, [])  # type: ignore[arg-type]

    def _start_live(self) -> None:
        """A fresh DataLoader iterator at the sampler's position: the workers are asked for its batches now."""
        self._pending = None
        if self._interrupted:
            self._loader = self._build()  # the old one's workers stop when it is collected
            self._interrupted = False
            self.rebuilds += 1
        self._history.clear()
        self._live, self._live_taken = iter(self._loader), self.sampler.taken

    def _check_bound(self) -> None:
        if not self.bound:
            raise ConfigError("this ResumableLoader was built ahead of its rank (a warm standby): "
                              "tierckpt.data.ahead(factory, ...) binds it; or call bind(rank, world_size)")

    def prefetch(self, *, fork: bool = True) -> bool:
        """Ask the workers for the batches of the current position now (``num_workers > 0``), so
        that they load while the caller does something else (the rest of the state loads: a
        ``tierckpt.data.item`` calls this as soon as its position arrived, before the model's
        tensors). The next ``iter`` delivers from them. Nothing happens when the next ``iter`` is
        served already: a rollback within the copies kept, or an iterator started at this
        position. ``fork=False``: only when the workers run already (no fork while other threads
        of this process are mid-read). Returns whether the workers were asked."""
        if not self.bound or self._options["num_workers"] == 0:
            return False
        if not fork and (self._interrupted or getattr(self._loader, "_iterator", None) is None):
            return False
        if self._pending is not None and self._live is not None:
            return False  # the copies kept and the live iterator serve the next iter
        self._token += 1  # an iterator made before must not read from the restarted workers
        self._start_live()
        self._pending = []  # the next iter goes on with the live iterator: nothing to replay
        return True

    def bind(self, rank: int, world_size: int) -> None:
        """Serve ``rank`` of ``world_size`` (a loader built ahead by a warm standby, or any other:
        the position goes back to the start of the current epoch). The workers stay: they hold the
        dataset, never the rank (the sampler, in this process, does)."""
        self.sampler.rebind(rank=rank, world_size=world_size)  # the DataLoader's own sampler object
        self._live, self._pending = None, None
        self._token += 1
        self.bound = True

    def worker_pids(self) -> list[int]:
        """The PIDs of the worker processes running now (none before the first ``iter``/``start``)."""
        it = getattr(self._loader, "_iterator", None)
        return [int(w.pid) for w in getattr(it, "_workers", []) if w.pid is not None]

    def _deliver(self, it: Iterator[Any], token: int, replay: list[Any]) -> Iterator[Any]:
        while True:
            if token != self._token:
                raise ProtocolError("this iterator's loader was repositioned (load_state_dict, set_epoch) or "
                                    "iterated again: call iter(loader) for the batches from the new position")
            taken = self.sampler.taken
            if replay:
                kept = replay.pop(0)
                batch = _copy(kept)  # the loop may change what it gets in place; the copy kept stays
            else:
                try:
                    batch = next(it)
                except StopIteration:
                    if token == self._token:
                        self.sampler.seek(self.sampler.epoch + 1, base=0, taken=0)
                        self._live = None
                        self._history.clear()
                    return
                except BaseException:
                    self._interrupted = True
                    self._live = None
                    raise
                self.sampler.taken = self._live_taken = min(taken + self.batch_size, self.sampler.share_size)
                if self.replay_batches:
                    self._history.append((taken, _copy(batch)))
                yield batch
                continue
            self.sampler.taken = min(taken + self.batch_size, self.sampler.share_size)
            yield batch

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch delivered, and what it is a position in."""
        s = self.sampler
        return {"kind": KIND, "epoch": s.epoch, "base": s.base, "taken": s.taken, "rank": s.rank,
                "world_size": s.world_size, "length": self.order.length, "seed": self.order.seed,
                "shuffle": self.order.shuffle, "drop_last": self.order.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Reposition to ``state`` (this rank's own, or any rank's of another world size).

        The same world size: exactly the saved position (``state`` must be this rank's). Another
        world size: resharded, every rank continues from the samples consumed globally
        (``EpochOrder.consumed``; see ``tierckpt.data.order``). Iterators made before stop
        delivering; the next ``iter(loader)`` starts at the position.
        Raises ``LoaderStateMismatchError`` when ``state`` is for another dataset or order.
        """
        for name, current in (("kind", KIND), ("length", self.order.length), ("seed", self.order.seed),
                              ("shuffle", self.order.shuffle), ("drop_last", self.order.drop_last)):
            saved = state.get(name)
            if saved != current:
                raise LoaderStateMismatchError(
                    f"the saved data position has {name}={saved!r}, this loader {name}={current!r}: build the "
                    f"loader as the run that saved it did (same dataset and order), or start the data afresh "
                    f"by leaving the loader out of the state dict", field=name, saved=saved, current=current,
                    rank=self.rank)
        epoch, base, taken, world = int(state["epoch"]), int(state["base"]), int(state["taken"]), \
            int(state["world_size"])
        self._pending = None
        if world == self.world_size:
            if int(state["rank"]) != self.rank:
                raise LoaderStateMismatchError(
                    f"rank {self.rank} was given rank {state['rank']}'s data position: each rank restores its "
                    "own (tierckpt.data.item keeps one per rank)", field="rank", saved=state["rank"],
                    current=self.rank, rank=self.rank)
            self._pending = self._replay_to(epoch, base, taken)
            self.sampler.seek(epoch, base=base, taken=taken)
        else:
            self.sampler.seek(epoch, base=self.order.consumed(base=base, world_size=world, taken=taken), taken=0)
        self._token += 1

    def _replay_to(self, epoch: int, base: int, taken: int) -> list[Any] | None:
        """The kept copies that lead from ``taken`` back to where the live iterator is, or None
        when the live iterator cannot serve that position (another epoch, further back)."""
        s = self.sampler
        if self._live is None or self._interrupted or (epoch, base) != (s.epoch, s.base):
            return None
        if taken == self._live_taken:
            return []
        starts = [t for t, _ in self._history]
        if taken not in starts:
            return None
        return [b for _, b in list(self._history)[starts.index(taken):]]


def _copy(batch: Any) -> Any:
    """A copy of a batch that shares no tensor memory with it (tensors cloned, containers rebuilt)."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_copy(b) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_copy(b) for b in batch)
    if isinstance(batch, dict):
        return type(batch)((k, _copy(v)) for k, v in batch.items())
    return copy.deepcopy(batch)
