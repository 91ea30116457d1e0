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

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tierckpt.errors import StorageError
from tierckpt.tiers.peer import agent_socket, local_request

__all__ = ["NodeBudget", "node_usage_bytes"]

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
