"""The node budget: one cap on everything a node's memory root holds, kept by the saves themselves.

Everything under the memory root counts, each inode once: every local rank's slots and
steps (of every namespace), replicas of other nodes and the peer cache. The cap is
``CheckpointConfig.node_memory_budget`` or, when a node agent runs, its ``--memory-budget``
(the smaller of the two when both are set).

Call order (a rank's ``SlotPool``, before it grows a slot or makes a new one, under
``lock()`` so that the node's ranks allocate one at a time): ``fits(extra)`` → if not,
``RankRuntime.evict_for_room(extra)`` calls ``agent_make_room(extra)`` (the agent evicts
peer-cache copies and replicas) and then deletes the node's own oldest committed steps,
those with a durable or peer copy first → ``fits`` again. What still does not fit fails the
save with ``MemoryBudgetError``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tierckpt.errors import MemoryBudgetError, StorageError
from tierckpt.node.sock import agent_socket
from tierckpt.tiers.peer import local_request

__all__ = ["NodeBudget", "no_room_error", "node_usage_bytes"]

AGENT_REFRESH_S = 10.0  # how long the agent's budget is trusted before it is asked again
_LOCK_NAME = ".budget.lock"


def node_usage_bytes(root: Path) -> int:
    """Bytes allocated under ``root``, each inode counted once (hard-linked slots too)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


class NodeBudget:
    """The budget of one memory root as this process sees it."""

    def __init__(self, memory_dir: str, configured: int | None) -> None:
        self.root = Path(memory_dir)
        self.configured = configured
        self._agent_limit: int | None = None
        self._asked_at = -AGENT_REFRESH_S

    def limit(self) -> int | None:
        """The cap in bytes (the configured one, the agent's, the smaller of both), None if none."""
        now = time.monotonic()
        if now - self._asked_at >= AGENT_REFRESH_S:
            self._asked_at = now
            self._agent_limit = None
            if agent_socket(self.root).exists():
                try:
                    reply = local_request(self.root, {"op": "budget"}, timeout=5.0)
                except StorageError:
                    reply = {}
                value = reply.get("budget_bytes")
                self._agent_limit = value if isinstance(value, int) and not isinstance(value, bool) else None
        limits = [v for v in (self.configured, self._agent_limit) if v is not None]
        return min(limits) if limits else None

    def used(self) -> int:
        return node_usage_bytes(self.root)

    def fits(self, extra: int) -> bool:
        limit = self.limit()
        return limit is None or self.used() + extra <= limit

    def agent_make_room(self, extra: int) -> bool:
        """Ask the node agent to evict peer-cache copies and replicas until ``extra`` fits; True if it freed any."""
        if not agent_socket(self.root).exists():
            return False
        before = self.used()
        try:
            local_request(self.root, {"op": "make_room", "bytes": extra}, timeout=60.0)
        except StorageError:
            return False
        return self.used() < before

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Serialize the node's allocations (every process saving into this memory root)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def no_room_error(nbytes: int, *, rank: int, held: int, free: int, where: Path, budget_bytes: int | None,
                  node: NodeBudget | None) -> StorageError | MemoryBudgetError:
    """Why a rank's new slot of ``nbytes`` cannot be had (its slots ``held``, ``free`` bytes in ``where``).

    A cap that binds (the rank's ``budget_bytes``, else the node budget) is a MemoryBudgetError
    naming the budget that works; no cap binding means the file system is full: a StorageError
    with errno ENOSPC, which a save with a durable tier falls back from.
    """
    node_limit = node.limit() if node is not None else None
    over_rank = budget_bytes is not None and held + nbytes > budget_bytes
    over_node = node is not None and node_limit is not None and not node.fits(nbytes)
    if over_rank:
        return MemoryBudgetError(
            f"rank {rank} needs {_mib(nbytes)} for a new slot but its slots already hold {_mib(held)} "
            f"(budget {_mib(budget_bytes or 0)}, {_mib(free)} free in {where}) and no older step can be "
            f"evicted; raise memory_budget_bytes to at least {held + nbytes} or free space in the memory "
            "tier's file system",
            tier="memory", rank=rank,
        )
    if over_node and node is not None and node_limit is not None:
        used = node.used()
        return MemoryBudgetError(
            f"rank {rank} needs {_mib(nbytes)} for a new slot but the node's memory root already holds "
            f"{_mib(used)} of its {_mib(node_limit)} budget and nothing more can be evicted (the newest "
            "committed step, steps in use, and other jobs' steps stay); raise node_memory_budget (or the "
            f"agent's --memory-budget) to at least {used + nbytes}, lower memory_steps_retained, or free "
            "the memory root",
            tier="memory", rank=rank,
        )
    full = StorageError(
        f"the memory tier's file system is full: rank {rank} needs {_mib(nbytes)} for a new slot, "
        f"{_mib(free)} are free in {where} and no older step can be evicted; free space there, give it "
        "more room (a larger tmpfs) or lower memory_steps_retained",
        tier="memory", rank=rank,
    )
    full.errno = errno.ENOSPC
    return full


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB ({n} bytes)"
