"""The Tier protocol: what a storage tier does, over bytes, for one namespace.

Call order for one save of step N with save id S (every backend):
  1. each rank:        put_file(N, S, "__<rank>_0.distcp", source)   invisible until commit
  2. the coordinator:  commit(N, S, {".metadata": ..., "manifest.json": ...})
                       writes the small files, then the COMMITTED marker last; from then on
                       list_steps() shows N as committed and readers may use it
  3. anyone, later:    delete(N) removes the marker first, then the data
Readers call list_steps() once, then read_file() for the small files and read_range() for
data (or, where a tier has it, ``open_reader(step, name)`` → ``RangeReader.read_into`` to read
straight into the caller's memory). A step is visible to readers only while its marker exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Union, runtime_checkable

__all__ = ["Hasher", "RangeReader", "Source", "StepListing", "Tier"]

#: bytes to store: a file to copy (or link) from, or an in-memory buffer
Source = Union[Path, bytes, bytearray, memoryview]


@dataclass(frozen=True)
class StepListing:
    """One step directory as a tier sees it."""

    step: int
    committed: bool
    files: Mapping[str, int] = field(default_factory=dict)  # name → size in bytes


class Hasher(Protocol):
    """A running checksum (``xxhash.xxh3_128()``): fed the bytes in file order as they land."""

    def update(self, data: memoryview) -> object: ...


class RangeReader(Protocol):
    """One data file of a step, open for reading into the caller's buffers.

    ``read_into(offset, out, hasher)`` fills ``out`` with the file's bytes from ``offset``
    (StorageError when the file is shorter) and feeds them to ``hasher`` in order, each piece
    while it is still in the CPU cache where the tier can (local files); ``concurrency`` is how
    many reads the tier serves well at once. ``read_scattered(offset, outs, hasher)`` is
    ``read_into`` of consecutive bytes into several buffers in turn (a record's header, its
    tensor's memory, its trailer), in one request where the tier has requests.
    ``close()`` when done.
    """

    concurrency: int

    def read_into(self, offset: int, out: memoryview, hasher: Hasher | None = None) -> None: ...

    def read_scattered(self, offset: int, outs: list[memoryview], hasher: Hasher | None = None) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Tier(Protocol):
    """A storage tier bound to one namespace. ``name`` is 'memory' or 'durable'."""

    name: str

    def location(self, step: int | None = None) -> str:
        """Human-readable location of the namespace or of one step (for logs and errors)."""
        ...

    def list_steps(self, *, include_uncommitted: bool = False) -> list[StepListing]:
        """Steps in ascending order; committed only unless asked."""
        ...

    def read_file(self, step: int, name: str) -> bytes:
        """A whole (small) file of a step; CheckpointNotFoundError when absent."""
        ...

    def read_range(self, step: int, name: str, offset: int, length: int) -> memoryview:
        """``length`` bytes of a step's file from ``offset``; StorageError when short."""
        ...

    def put_file(self, step: int, save_id: str, name: str, source: Source) -> None:
        """Store one data file of save ``save_id``; invisible until ``commit``."""
        ...

    def commit(self, step: int, save_id: str, files: Mapping[str, bytes]) -> None:
        """Store the small files (must include manifest.json), then the marker, last."""
        ...

    def delete(self, step: int) -> None:
        """Remove a step: the marker first, then the data. Missing steps are ignored."""
        ...
