"""Shared-memory slots: preallocated, memory-mapped files that saves copy tensors into.

Each rank owns ``<memory root>/<namespace>/.slots/rank_<r>/slot_<k>``. A save copies its
data into a free slot, then links the slot into the step's staging directory, so the
committed step's data file *is* the slot (no second copy). A slot is free exactly when
nothing else links to it (``st_nlink == 1``): retention frees slots by deleting steps,
and a crashed save's staging directory frees them when garbage-collected. Mappings stay
open across saves, so after the first save a copy touches no new page.

Call order (one rank): ``acquire(nbytes)`` → write through ``Slot.buffer`` → the memory
tier's ``put_file(..., slot.path)`` → ``release(slot)``.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tierckpt import layout
from tierckpt.errors import MemoryBudgetError, StorageError

__all__ = ["Slot", "SlotPool"]


@dataclass
class Slot:
    """One mapped slot file; ``buffer`` is a uint8 tensor over the whole mapping."""

    path: Path
    size: int
    _mm: mmap.mmap | None = field(default=None, repr=False)
    buffer: torch.Tensor | None = field(default=None, repr=False)

    def map(self) -> None:
        self.unmap()
        if self.size == 0:
            self.buffer = torch.empty(0, dtype=torch.uint8)
            return
        with open(self.path, "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), self.size, flags=mmap.MAP_SHARED)
        self.buffer = torch.frombuffer(self._mm, dtype=torch.uint8)

    def unmap(self) -> None:
        self.buffer = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes when it does
            self._mm = None

    def links(self) -> int:
        try:
            return os.stat(self.path).st_nlink
        except FileNotFoundError:
            return 0


class SlotPool:
    """The slots of one rank. ``evict`` frees memory by deleting an old step (True if it did)."""

    def __init__(
        self,
        ns_dir: Path,
        rank: int,
        *,
        budget_bytes: int | None,
        evict: Callable[[], bool],
        gc: Callable[[], object],
    ) -> None:
        self.dir = ns_dir / layout.SLOTS / f"rank_{rank}"
        self.rank = rank
        self.budget_bytes = budget_bytes
        self._evict = evict
        self._gc = gc
        self._slots: dict[str, Slot] = {}
        self._reserved: set[str] = set()

    def acquire(self, nbytes: int) -> Slot:
        """A free slot resized to ``nbytes`` and mapped; MemoryBudgetError if none fits."""
        if self.budget_bytes is not None and nbytes > self.budget_bytes:
            raise MemoryBudgetError(
                f"one step of rank {self.rank} needs {_mib(nbytes)} of shared memory, but "
                f"memory_budget_bytes is {_mib(self.budget_bytes)}; raise memory_budget_bytes "
                f"to at least {nbytes}",
                tier="memory", rank=self.rank,
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):
            slot = self._find_free(nbytes)
            if slot is not None:
                break
            if self._fits(nbytes):
                slot = self._new_slot()
                break
            if attempt == 0:
                self._gc()
            while not self._fits(nbytes) and self._find_free(nbytes) is None and self._evict():
                pass
        else:
            held = sum(s.size for s in self._scan().values())
            raise MemoryBudgetError(
                f"rank {self.rank} needs {_mib(nbytes)} for a new slot but its slots already "
                f"hold {_mib(held)} of the {_mib(self.budget_bytes or 0)} budget and no older "
                "step can be evicted; raise memory_budget_bytes or lower memory_steps_retained",
                tier="memory", rank=self.rank,
            )
        self._resize(slot, nbytes)
        self._reserved.add(slot.path.name)
        return slot

    def release(self, slot: Slot) -> None:
        """Hand the slot back after it was linked (or after a failed save)."""
        self._reserved.discard(slot.path.name)

    def close(self) -> None:
        """Unmap every slot and delete the free ones: their memory goes back to the node.

        Slots that hold committed steps stay (they are the memory tier); a later job
        allocates new slots on its first saves.
        """
        for slot in self._slots.values():
            slot.unmap()
        self._slots.clear()
        if self.dir.exists():
            for name, slot in self._scan().items():
                if name not in self._reserved and slot.links() == 1:
                    slot.unmap()
                    slot.path.unlink(missing_ok=True)
            self._slots.clear()

    def held_bytes(self) -> int:
        return sum(s.size for s in self._scan().values())

    def mapped(self, path: Path) -> torch.Tensor | None:
        """This process's mapping of the slot ``path`` links to (same inode), else None.

        A load in the process that saved the step reads the slot through the mapping the save
        already faulted in, instead of mapping (or reading) the file again.
        """
        try:
            want = os.stat(path)
        except OSError:
            return None
        for slot in list(self._slots.values()):
            if slot.buffer is None or slot._mm is None:
                continue
            try:
                st = os.stat(slot.path)
            except OSError:
                continue
            if (st.st_ino, st.st_dev) == (want.st_ino, want.st_dev) and st.st_size == slot.size:
                return slot.buffer
        return None

    # -- internals ----------------------------------------------------------------
    def _scan(self) -> dict[str, Slot]:
        found = {}
        for entry in os.scandir(self.dir):
            if entry.name.startswith("slot_"):
                slot = self._slots.get(entry.name)
                size = entry.stat().st_size
                if slot is None or slot.size != size:
                    if slot is not None:
                        slot.unmap()
                    slot = Slot(Path(entry.path), size)
                    self._slots[entry.name] = slot
                found[entry.name] = slot
        for gone in set(self._slots) - set(found):
            self._slots.pop(gone).unmap()
        return found

    def _find_free(self, nbytes: int) -> Slot | None:
        free = [
            s for name, s in self._scan().items()
            if name not in self._reserved and s.links() == 1
        ]
        if not free:
            return None
        # prefer an exact fit (warm pages, no remap), then the largest
        free.sort(key=lambda s: (s.size != nbytes, -s.size))
        slot = free[0]
        if slot.size < nbytes and not self._fits(nbytes - slot.size):
            return None
        return slot

    def _fits(self, extra: int) -> bool:
        if self.budget_bytes is not None and self.held_bytes() + extra > self.budget_bytes:
            return False
        st = os.statvfs(self.dir)
        return st.f_bavail * st.f_frsize >= extra

    def _new_slot(self) -> Slot:
        taken = {int(n.split("_", 1)[1]) for n in self._scan() if n.split("_", 1)[1].isdigit()}
        k = next(i for i in range(len(taken) + 1) if i not in taken)
        path = self.dir / f"slot_{k}"
        path.touch()
        slot = Slot(path, 0)
        self._slots[path.name] = slot
        return slot

    def _resize(self, slot: Slot, nbytes: int) -> None:
        if slot.size != nbytes or slot.buffer is None:
            try:
                if nbytes > slot.size:
                    # reserve the pages now: a full tmpfs then fails here with ENOSPC
                    # instead of killing the process with SIGBUS during the copy
                    fd = os.open(slot.path, os.O_RDWR)
                    try:
                        os.posix_fallocate(fd, 0, nbytes)
                    finally:
                        os.close(fd)
                os.truncate(slot.path, nbytes)
            except OSError as exc:
                raise StorageError(
                    f"could not size shared-memory slot {slot.path} to {nbytes} bytes: {exc}",
                    tier="memory", path=str(slot.path),
                ) from exc
            slot.size = nbytes
            slot.map()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB ({n} bytes)"
