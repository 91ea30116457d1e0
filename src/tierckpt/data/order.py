"""The order of an epoch's samples and which rank takes which: ``DistributedSampler``'s, resumable.

An epoch's *global order* is a function of ``(seed, epoch)`` alone: ``torch.randperm`` of the
dataset's length on a generator seeded with ``seed + epoch`` (``arange`` without shuffling), the
very order ``torch.utils.data.DistributedSampler`` draws. Ranks of a world of size W that start
striding at global offset ``base`` take ``order[base:]``, padded to a multiple of W by repeating its
first samples (or cut to one with ``drop_last``), rank r every W-th sample from position r. With
``base = 0`` that is ``DistributedSampler``'s share of every rank, sample for sample.

After every rank took k samples, the samples consumed globally are the prefix
``order[:base + k*W]`` (at most the length): that is what a resharded restart continues from.
A world of W' ranks restarts striding at ``base' = base + k*W`` and nothing consumed comes again,
nothing left is skipped (but for DistributedSampler's padding duplicates and ``drop_last``'s tail).

``EpochOrder`` is the policy (a frozen value, pure methods); ``ResumableSampler`` is the
``torch.utils.data.Sampler`` that yields one rank's share from a position.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler

from tierckpt.errors import ConfigError

__all__ = ["EpochOrder", "ResumableSampler"]


def _check_int(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class EpochOrder:
    """The global order of every epoch and each rank's share of it (see the module doc).

    ``length``: the dataset's number of samples; ``seed``: the shuffle's seed (the same on
    every rank); ``shuffle``: False keeps the dataset's order; ``drop_last``: cut the tail
    that does not divide by the world size instead of padding it (DistributedSampler's flag).
    """

    length: int
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False

    def __post_init__(self) -> None:
        _check_int("EpochOrder.length", self.length, 0)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"EpochOrder.seed must be an int, got {self.seed!r}")

    def global_order(self, epoch: int) -> list[int]:
        """Every sample of ``epoch`` once, in the order the ranks consume them."""
        if not self.shuffle:
            return list(range(self.length))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.length, generator=g).tolist()

    def share_size(self, *, base: int, world_size: int) -> int:
        """How many samples each rank takes of ``order[base:]`` (DistributedSampler's ``num_samples``)."""
        rest = max(0, self.length - base)
        if self.drop_last and rest % world_size:
            return max(0, math.ceil((rest - world_size) / world_size))
        return math.ceil(rest / world_size)

    def share(self, epoch: int, *, base: int, world_size: int, rank: int) -> list[int]:
        """Rank ``rank``'s samples of ``epoch`` for a world that started striding at ``base``."""
        rest = self.global_order(epoch)[base:]
        total = self.share_size(base=base, world_size=world_size) * world_size
        if total > len(rest) and rest:  # pad by repeating the first samples, as DistributedSampler
            rest = (rest * math.ceil(total / len(rest)))[:total]
        return rest[rank:total:world_size]

    def consumed(self, *, base: int, world_size: int, taken: int) -> int:
        """Samples of the global order consumed once every rank took ``taken`` of its share."""
        return min(self.length, base + taken * world_size)


class ResumableSampler(Sampler[int]):
    """One rank's share of each epoch (``EpochOrder``), from a position; ``DistributedSampler``'s
    indices when started at the beginning.

    Call order (the owner, usually ``ResumableLoader``, in the training process): ``set_epoch(e)``
    at an epoch's start, or ``seek(epoch, base, taken)`` to resume; then ``iter(sampler)`` (the
    ``DataLoader`` calls it when an iterator starts or is reset) yields the share from ``taken`` on.
    The sampler does not count what it yields: a ``DataLoader`` with workers draws indices ahead
    of the batches the loop got; its owner counts those and seeks.
    """

    def __init__(self, order: EpochOrder, *, rank: int, world_size: int) -> None:
        _check_int("world_size", world_size, 1)
        _check_int("rank", rank, 0)
        if rank >= world_size:
            raise ConfigError(f"rank {rank} is not below world_size {world_size}")
        self.order = order
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.base = 0  # where the current world started striding in this epoch's global order
        self.taken = 0  # samples of this rank's share consumed before the next iterator

    def rebind(self, *, rank: int, world_size: int) -> None:
        """Serve ``rank`` of ``world_size`` from now on, from the start of the current epoch."""
        _check_int("world_size", world_size, 1)
        _check_int("rank", rank, 0)
        if rank >= world_size:
            raise ConfigError(f"rank {rank} is not below world_size {world_size}")
        self.rank, self.world_size = rank, world_size
        self.seek(self.epoch, base=0, taken=0)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (from its first sample) unless it is the current one: a resumed loop that
        calls ``set_epoch`` with the epoch it resumed in keeps its position."""
        _check_int("epoch", epoch, 0)
        if epoch != self.epoch:
            self.seek(epoch, base=0, taken=0)

    def seek(self, epoch: int, *, base: int, taken: int) -> None:
        _check_int("epoch", epoch, 0)
        _check_int("base", base, 0)
        _check_int("taken", taken, 0)
        self.epoch, self.base, self.taken = epoch, min(base, self.order.length), taken

    @property
    def share_size(self) -> int:
        return self.order.share_size(base=self.base, world_size=self.world_size)

    def __iter__(self) -> Iterator[int]:
        share = self.order.share(self.epoch, base=self.base, world_size=self.world_size, rank=self.rank)
        return iter(share[self.taken:])

    def __len__(self) -> int:
        return max(0, self.share_size - self.taken)
