"""The data pipeline's position as a checkpoint item: one per rank, beside the model's state.

``item(loader)`` is a ``Stateful`` (DCP's protocol: ``state_dict``/``load_state_dict``) for the
top level of a state dict that ``Checkpointer.save``/``load`` (or ``dcp.save``/``dcp.load``) take.
Its state dict holds two entries:

- ``layout.rank_item_key(rank)`` (``__rank<r>__``): this rank's loader state, the whole of it
  (``loader_state``), as one ``torch.save`` blob. Its key is this rank's own: DCP never
  deduplicates it with another rank's, a load reads only its own.
- ``position``: the world's position (``ResumableLoader``: epoch and samples consumed globally;
  the same on every rank of a data-parallel loop that takes a batch per step on each rank), saved
  once (DCP deduplicates an item that every rank saves under one key). A load into a world of
  another size, where ranks have no item of their own or another rank's, continues from it.

Call order (each rank): ``state = {"model": ..., "data": item(loader)}``; ``ck.save(step, state)``
(``state_dict`` at the call); ``ck.load(state)`` (``state_dict`` for the structure, then
``load_state_dict`` with what the step holds). Blobs load with ``torch.load(weights_only=True)``.

``loader_state``/``restore_loader`` work on a ``ResumableLoader`` and on torchdata's
``StatefulDataLoader`` (anything with ``state_dict``/``load_state_dict``; torchdata is not imported).
A ``StatefulDataLoader``'s state is opaque: it restores at the world size that saved it, else
``LoaderStateMismatchError``.
"""

from __future__ import annotations

import io
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from tierckpt import layout
from tierckpt.data.loader import KIND, ResumableLoader
from tierckpt.errors import ConfigError, LoaderStateMismatchError

__all__ = ["LoaderItem", "StatefulLoader", "item", "loader_state", "restore_loader"]

OPAQUE = "stateful"  # the kind of a position that only the world size that saved it can restore


@runtime_checkable
class StatefulLoader(Protocol):
    """What ``loader_state``/``restore_loader`` need: torchdata's ``StatefulDataLoader`` has it."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def loader_state(loader: StatefulLoader) -> dict[str, Any]:
    """The loader's position now: what the loop consumed (``ResumableLoader``), or the loader's own
    ``state_dict()`` (a ``StatefulDataLoader`` counts the batches it yielded, likewise)."""
    if not isinstance(loader, StatefulLoader):
        raise ConfigError(f"{type(loader).__name__} has no state_dict()/load_state_dict(): use "
                          "tierckpt.data.ResumableLoader or torchdata's StatefulDataLoader")
    return loader.state_dict()


def restore_loader(loader: StatefulLoader, state: dict[str, Any]) -> None:
    """Reposition ``loader`` to ``state`` (from ``loader_state``); its next iterator starts there."""
    if not isinstance(loader, StatefulLoader):
        raise ConfigError(f"{type(loader).__name__} has no state_dict()/load_state_dict(): use "
                          "tierckpt.data.ResumableLoader or torchdata's StatefulDataLoader")
    loader.load_state_dict(state)


def _pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(raw: Any, what: str) -> Any:
    if not isinstance(raw, (bytes, bytearray)):
        raise LoaderStateMismatchError(f"the checkpoint's {what} is a {type(raw).__name__}, not a tierckpt.data "
                                       "blob: was it saved by another version?", field="kind")
    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)


class LoaderItem:
    """A loader as a per-rank checkpoint item (see the module doc); ``item(loader)`` makes one.

    ``rank``/``world_size``: the loader's own (``ResumableLoader``), else the default process
    group's, else give them. ``restored`` is what the latest ``load_state_dict`` did: ``"exact"``
    (this rank's own position), ``"resharded"`` (from the world's position) or None; ``early``,
    whether tierckpt's load applied it before the model's tensors (``load_early``); ``prefetched``,
    when the latest load asked the workers for the position's first batches: ``"early"`` (while the
    tensors loaded: the workers ran already), ``"at the end"`` (they were forked then) or None.
    """

    def __init__(self, loader: StatefulLoader, *, rank: int | None = None, world_size: int | None = None) -> None:
        if not isinstance(loader, StatefulLoader):
            raise ConfigError(f"{type(loader).__name__} has no state_dict()/load_state_dict(): use "
                              "tierckpt.data.ResumableLoader or torchdata's StatefulDataLoader")
        if isinstance(loader, ResumableLoader):
            rank, world_size = loader.rank, loader.world_size
        elif rank is None or world_size is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise ConfigError("tierckpt.data.item(loader) needs rank= and world_size= for a loader built "
                                  "before init_process_group")
            rank, world_size = dist.get_rank(), dist.get_world_size()
        self.loader = loader
        self.rank = rank
        self.world_size = world_size
        self.restored: str | None = None
        self.early = False  # the latest load repositioned the loader before the model's tensors (load_early)
        self.prefetched: str | None = None  # when a load asked the workers for the position's batches

    def _position(self, state: dict[str, Any]) -> dict[str, Any]:
        if isinstance(self.loader, ResumableLoader):
            return {k: v for k, v in state.items() if k != "rank"}
        return {"kind": OPAQUE, "world_size": self.world_size}

    def state_dict(self) -> dict[str, Any]:
        self.early, self.prefetched = False, None  # a load starts here too (DCP asks for the structure)
        state = loader_state(self.loader)
        return {"position": _pack(self._position(state)),
                layout.rank_item_key(self.rank): _pack({"rank": self.rank, "world_size": self.world_size,
                                                        "state": state})}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Reposition the loader to the saved position (this rank's own, or resharded from the
        world's), then ask its workers for the position's first batches (``prefetch``)."""
        self._load(state_dict, fork=True)

    def _load(self, state_dict: dict[str, Any], *, fork: bool) -> None:
        position = _unpack(state_dict["position"], "data position")
        saved_world = int(position.get("world_size", -1))
        if saved_world == self.world_size:  # every rank of that world saved its own item: take it
            own = _unpack(state_dict[layout.rank_item_key(self.rank)], "rank's data state")
            if int(own["rank"]) != self.rank or int(own["world_size"]) != self.world_size:
                raise LoaderStateMismatchError(
                    f"rank {self.rank} found the data state of rank {own['rank']} of {own['world_size']}",
                    field="rank", saved=own["rank"], current=self.rank, rank=self.rank)
            restore_loader(self.loader, own["state"])
            self.restored = "exact"
            self._prefetch(fork)
            return
        if position.get("kind") != KIND or not isinstance(self.loader, ResumableLoader):
            raise LoaderStateMismatchError(
                f"the data position was saved by {saved_world} rank(s) and this world has {self.world_size}: "
                f"only a tierckpt.data.ResumableLoader's position reshards (a {position.get('kind')!r} state is "
                "opaque to tierckpt); restart with the same world size or use ResumableLoader",
                field="world_size", saved=saved_world, current=self.world_size, rank=self.rank)
        restore_loader(self.loader, position)
        self.restored = "resharded"
        self._prefetch(fork)

    def _prefetch(self, fork: bool) -> None:
        if isinstance(self.loader, ResumableLoader) and self.loader.prefetch(fork=fork):
            self.prefetched = "at the end" if fork else "early"

    def load_early(self, state_dict: dict[str, Any]) -> None:
        """``load_state_dict`` as soon as this item's entries were read, before the rest of the
        state (tierckpt's load calls it from the reading thread; DCP then calls
        ``load_state_dict`` with the same entries at the end, which keeps what this started): the
        loader is repositioned and its running workers start on the position's batches while the
        model's tensors load. It forks no worker: ``load_state_dict`` does, at the end."""
        self._load(state_dict, fork=False)
        self.early = True


def item(loader: StatefulLoader, *, rank: int | None = None, world_size: int | None = None) -> LoaderItem:
    """``loader`` as a checkpoint item for the top level of a state dict: ``{"data": item(loader)}``."""
    return LoaderItem(loader, rank=rank, world_size=world_size)
