"""Shared-memory slots: preallocated, memory-mapped files that saves copy tensors into.

Each rank owns ``<memory root>/<namespace>/.slots/rank_<r>/slot_<k>``. A save copies its
data into a free slot, then links the slot into the step's staging directory, so the
committed step's data file *is* the slot (no second copy). A slot is free exactly when
nothing else links to it (``st_nlink == 1``): retention frees slots by deleting steps,
and a crashed save's staging directory frees them when garbage-collected. Mappings stay
open across saves, so after the first save a copy touches no new page.

Call order (one rank): ``acquire(nbytes)`` → write through ``Slot.buffer`` → the memory
tier's ``put_file(..., slot.path)`` → ``release(slot)``. ``reserve(nbytes, count)`` may run
on a background thread at any time: it allocates, maps and faults in free slots ahead of
need (under a hidden name, published by a rename), so a later ``acquire`` finds one warm.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tierckpt import layout
from tierckpt.errors import MemoryBudgetError, StorageError
from tierckpt.node.budget import NodeBudget, no_room_error
from tierckpt.tiers.local import pid_alive

__all__ = ["Slot", "SlotPool"]

RELEASE_WAIT_S = 600.0  # longest a save waits for a durable copy to release a slot under the budget
_log = logging.getLogger("tierckpt.staging")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; Python < 3.13 lacks the name
_PAGE = mmap.PAGESIZE
_PREALLOC = ".prealloc-"  # a slot being reserved: not a "slot_" name until it is ready


@dataclass
class Slot:
    """One mapped slot file; ``buffer`` is a uint8 tensor over the whole mapping."""

    path: Path
    size: int
    _mm: mmap.mmap | None = field(default=None, repr=False)
    buffer: torch.Tensor | None = field(default=None, repr=False)
    #: the mapping's address while it is registered with CUDA (``snapshot.Stager._pin``)
    registered: int | None = field(default=None, repr=False)

    def map(self) -> None:
        self.unmap()
        if self.size == 0:
            self.buffer = torch.empty(0, dtype=torch.uint8)
            return
        with open(self.path, "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), self.size, flags=mmap.MAP_SHARED)
        self.buffer = torch.frombuffer(self._mm, dtype=torch.uint8)

    def fault_in(self) -> None:
        """Map every page now, so the first copy into the slot takes no page fault."""
        if self._mm is None or self.buffer is None:
            return
        try:
            self._mm.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):  # older kernel: touch one byte per page (the slot is free)
            self.buffer[::_PAGE].zero_()

    def unregister(self) -> None:
        """Undo the CUDA host registration of this mapping (before it goes: CUDA keeps a stale
        registration of an unmapped range, and a later mapping at the same address is then
        read and written by DMA through the old pages: a load into CUDA tensors from it was
        torn on an H100)."""
        if self.registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self.registered)
            self.registered = None

    def unmap(self) -> None:
        self.unregister()
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
    """The slots of one rank. ``evict(nbytes)`` frees memory by deleting an old step (True if it did).

    Two caps apply: ``budget_bytes`` (this rank's slots) and ``node`` (everything the node's
    memory root holds, every rank's slots included), checked before a slot grows or is made.
    """

    def __init__(
        self,
        ns_dir: Path,
        rank: int,
        *,
        budget_bytes: int | None,
        evict: Callable[[int], bool],
        gc: Callable[[], object],
        steps_retained: int = 1,
        node: NodeBudget | None = None,
    ) -> None:
        self.dir = ns_dir / layout.SLOTS / f"rank_{rank}"
        self.rank = rank
        self.budget_bytes = budget_bytes
        self.steps_retained = steps_retained
        self._evict = evict
        self._gc = gc
        self.node = node  # the node-wide cap over the whole memory root (None: none)
        self._slots: dict[str, Slot] = {}
        self._reserved: set[str] = set()
        self._pending = 0  # bytes that reserve() is allocating now (count against the budget)
        self._cond = threading.Condition()  # guards the slot table; signalled when a reservation lands

    def acquire(self, nbytes: int) -> Slot:
        """A free slot resized to ``nbytes`` and mapped; MemoryBudgetError if none fits."""
        with self._cond:
            if self._pending and self._find_free(nbytes) is None:
                self._cond.wait_for(lambda: not self._pending)  # a warm slot is on its way
            return self._acquire_locked(nbytes)

    def _acquire_locked(self, nbytes: int) -> Slot:
        if self.budget_bytes is not None and nbytes > self.budget_bytes:
            raise MemoryBudgetError(
                f"one step of rank {self.rank} needs {_mib(nbytes)} of shared memory, but "
                f"memory_budget_bytes is {_mib(self.budget_bytes)}; raise memory_budget_bytes "
                f"to at least {nbytes}",
                tier="memory", rank=self.rank,
            )
        if self.budget_bytes is not None and 2 * nbytes > self.budget_bytes:
            # the newest committed step keeps its slot until this save commits: two slots at least
            raise MemoryBudgetError(
                f"a save of rank {self.rank} needs two slots of {_mib(nbytes)} (the step being written "
                f"and the newest committed step, kept until the new one commits), but memory_budget_bytes "
                f"is {_mib(self.budget_bytes)}; set memory_budget_bytes to at least {2 * nbytes} "
                f"({(self.steps_retained + 1) * nbytes} keeps all memory_steps_retained="
                f"{self.steps_retained} steps without evicting)",
                tier="memory", rank=self.rank,
            )
        node_limit = self.node.limit() if self.node is not None else None
        if node_limit is not None and nbytes > node_limit:
            raise MemoryBudgetError(
                f"one step of rank {self.rank} needs {_mib(nbytes)} of shared memory, but the node's memory "
                f"budget is {_mib(node_limit)}; raise node_memory_budget (or the agent's --memory-budget) "
                f"to at least {2 * nbytes} per local rank",
                tier="memory", rank=self.rank,
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        slot: Slot | None = None
        with self._node_lock():
            for attempt in range(3):
                slot = self._find_free(nbytes)
                if slot is not None:
                    break
                if self._fits(nbytes):
                    slot = self._new_slot()
                    break
                if attempt == 0:
                    self._gc()
                while not self._fits(nbytes) and self._find_free(nbytes) is None and self._evict(nbytes):
                    pass
            if slot is not None:
                self._resize(slot, nbytes)  # under the node lock: the next rank sees these bytes
        if slot is None:
            slot = self._await_release(nbytes)
            if slot is None:
                raise self._no_room(nbytes)
            self._resize(slot, nbytes)
        self._reserved.add(slot.path.name)
        return slot

    def _node_lock(self) -> contextlib.AbstractContextManager[None]:
        if self.node is None or self.node.limit() is None:
            return contextlib.nullcontext()
        return self.node.lock()

    def _no_room(self, nbytes: int) -> StorageError | MemoryBudgetError:
        """The error of a slot that nothing can make room for: a budget's, or a full file system's."""
        st = os.statvfs(self.dir)
        return no_room_error(nbytes, rank=self.rank, held=sum(s.size for s in self._scan().values()),
                             free=st.f_bavail * st.f_frsize, where=self.dir.parent.parent.parent,
                             budget_bytes=self.budget_bytes, node=self.node)

    def _await_release(self, nbytes: int) -> Slot | None:
        """Wait for a slot that something other than the newest step holds to come free.

        Eviction leaves only the newest committed step in memory, so any other linked slot is
        a durable copy still reading it (a pin) or a save still committing: both end on their
        own, and waiting for them is back-pressure, as for a full drain queue. None when no
        such slot exists (waiting cannot help) or after ``RELEASE_WAIT_S``.
        """
        deadline = time.monotonic() + RELEASE_WAIT_S
        warned = False
        while time.monotonic() < deadline:
            busy = [s for name, s in self._scan().items() if name not in self._reserved and s.links() > 1]
            if len(busy) < 2:
                return None
            if not warned:
                _log.warning("[Rank %d] memory budget full: waiting for a durable copy or a commit to "
                             "release a slot (%d held)", self.rank, len(busy))
                warned = True
            self._cond.wait(0.005)  # called under the lock: let release() and reserve() run meanwhile
            self._evict(nbytes)  # a commit that just landed may have made an older step evictable
            slot = self._find_free(nbytes)
            if slot is None and self._fits(nbytes):
                slot = self._new_slot()
            if slot is not None:
                return slot
        return None

    def release(self, slot: Slot) -> None:
        """Hand the slot back after it was linked (or after a failed save)."""
        with self._cond:
            self._reserved.discard(slot.path.name)

    def reserve(self, nbytes: int, count: int) -> int:
        """Make ``count`` slots of ``nbytes`` exist, allocated, mapped and faulted in.

        Runs on any thread, concurrently with ``acquire``; the heavy part (allocating and
        touching the pages) happens outside the lock, on a free slot of another size marked
        taken, or on a new file under a hidden name. Stops early, quietly, where the budget
        or the file system has no room: the saves then allocate (or evict) as before.
        Returns the number of slots it prepared.
        """
        if nbytes <= 0:
            return 0
        self.dir.mkdir(parents=True, exist_ok=True)
        self._remove_dead_reservations()
        done = 0
        while True:
            with self._cond:
                target, extra = self._next_to_reserve(nbytes, count)
                if extra < 0:
                    return done
                self._pending += extra
                if target is not None:
                    self._reserved.add(target.path.name)
            try:
                if target is None:
                    self._prepare_new(nbytes)
                else:
                    self._resize(target, nbytes)
                    target.fault_in()
            except StorageError:
                return done
            finally:
                with self._cond:
                    self._pending -= extra
                    if target is not None:
                        self._reserved.discard(target.path.name)
                    self._cond.notify_all()
            done += 1

    def _next_to_reserve(self, nbytes: int, count: int) -> tuple[Slot | None, int]:
        """(a free slot of another size to resize, or None for a new one; extra bytes); -1: nothing."""
        slots = self._scan()
        headroom = 0
        if self.node is not None and self.node.limit() is not None:
            # the node's other ranks allocate from the same budget: hold one spare slot at most,
            # and leave room for one more slot of theirs, so that no rank's reserve starves another
            count, headroom = min(count, 2), nbytes
        if sum(1 for s in slots.values() if s.size == nbytes) >= count:
            return None, -1
        for name, slot in slots.items():
            if name not in self._reserved and slot.size != nbytes and slot.links() == 1:
                extra = max(0, nbytes - slot.size)
                return (slot, extra) if self._fits(extra + headroom) else (None, -1)
        if len(slots) < count and self._fits(nbytes + headroom):
            return None, nbytes
        return None, -1

    def _prepare_new(self, nbytes: int) -> None:
        """Allocate and fault in a new slot under a hidden name, then publish it (under the lock)."""
        tmp = self.dir / f"{_PREALLOC}{os.getpid()}-{threading.get_ident()}"
        tmp.touch()
        slot = Slot(tmp, 0)
        try:
            self._resize(slot, nbytes)
            slot.fault_in()
            with self._cond:
                name = self._free_name()
                os.rename(tmp, self.dir / name)
                slot.path = self.dir / name
                self._slots[name] = slot
        except BaseException:
            slot.unmap()
            tmp.unlink(missing_ok=True)
            raise

    def _remove_dead_reservations(self) -> None:
        """A process that died while reserving left a hidden file: delete it."""
        for entry in os.scandir(self.dir):
            if entry.name.startswith(_PREALLOC):
                pid = entry.name[len(_PREALLOC):].split("-", 1)[0]
                if pid.isdigit() and not pid_alive(int(pid)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)

    def close(self) -> None:
        """Unmap every slot and delete the free ones: their memory goes back to the node.

        Slots that hold committed steps stay (they are the memory tier); a later job
        allocates new slots on its first saves.
        """
        with self._cond:
            self._close_locked()

    def _close_locked(self) -> None:
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
        """Bytes of this rank's slots, counting those being reserved now."""
        return sum(s.size for s in self._scan().values()) + self._pending

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
                # a taken slot keeps its object: reserve() may be resizing it outside the lock
                if slot is None or (slot.size != size and entry.name not in self._reserved):
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
        if extra > 0 and self.node is not None and not self.node.fits(extra):
            return False
        st = os.statvfs(self.dir)
        return st.f_bavail * st.f_frsize >= extra

    def _free_name(self) -> str:
        taken = {int(n.split("_", 1)[1]) for n in self._scan() if n.split("_", 1)[1].isdigit()}
        return f"slot_{next(i for i in range(len(taken) + 1) if i not in taken)}"

    def _new_slot(self) -> Slot:
        path = self.dir / self._free_name()
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
