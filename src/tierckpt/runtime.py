"""What one rank keeps between saves: tiers, its slot pool, an I/O thread pool.

The seed's usage builds a new writer for every step, so the state that makes saves
cheap (open mappings of the shared-memory slots, an S3 client) cannot live in the
writer. ``runtime_for(config, rank)`` returns one ``RankRuntime`` per (config, rank) in
this process; ``Checkpointer`` owns and closes its own.
"""

from __future__ import annotations

import atexit
import threading
from concurrent.futures import ThreadPoolExecutor

from tierckpt.config import CheckpointConfig
from tierckpt.errors import StorageError
from tierckpt.observability import StepLogger
from tierckpt.policy import RetentionPolicy
from tierckpt.protect import read_protected
from tierckpt.snapshot import Stager
from tierckpt.staging import SlotPool
from tierckpt.tiers import LocalTier, Tier, open_durable, open_memory
from tierckpt.tiers.peer import notify_committed

__all__ = ["RankRuntime", "runtime_for"]


class RankRuntime:
    """Tiers, slots and threads of one rank; ``save_lock`` admits one save at a time."""

    def __init__(self, config: CheckpointConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.memory: LocalTier = open_memory(config)
        self._durable: Tier | None = None
        self._durable_lock = threading.Lock()
        self.log = StepLogger("runtime", rank, config.logger)
        self.in_flight: set[str] = set()  # save ids this rank is writing now
        self.published_key: str | None = None  # c10d store key of the last step published to other nodes
        #: errors that background threads (node commit) hit and that are bugs, not faults:
        #: raised by this rank's next save instead of being logged and forgotten
        self.background_errors: list[BaseException] = []
        self.pool = SlotPool(
            self.memory.ns_dir, rank,
            budget_bytes=config.memory_budget_bytes,
            evict=self.evict_oldest,
            gc=lambda: self.memory.gc_staging(keep=set(self.in_flight)),
            steps_retained=config.memory_steps_retained,
        )
        self.stager = Stager(self.pool)
        self.executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="tierckpt-io")
        self.save_lock = threading.Lock()
        self.memory_retention = RetentionPolicy(config.memory_steps_retained)
        self.durable_retention = RetentionPolicy(config.durable_steps_retained)

    @property
    def durable(self) -> Tier | None:
        """The durable tier, opened on first use (an S3 client costs a round trip)."""
        with self._durable_lock:
            if self._durable is None and self.config.durable_url is not None:
                self._durable = open_durable(self.config)
            return self._durable

    def committed_in_memory(self, step: int) -> None:
        """Tell this node's agent, if one runs, that ``step`` is committed here (never waits)."""
        notify_committed(self.config.memory_dir, self.config.namespace, step)

    def evict_oldest(self) -> bool:
        """Delete the oldest committed memory step that is not the newest; True if one went.

        Steps the node agent protects (``tierckpt.protect``) go last: only when nothing else
        can, since a save that finds no slot fails (the budget then holds fewer slots than
        ``memory_steps_retained + 2``; the warning says so).
        """
        steps = [s.step for s in self.memory.list_steps()]
        protected = read_protected(self.memory.ns_dir)
        victims = RetentionPolicy.select_for_eviction(steps, protected) or RetentionPolicy.select_for_eviction(steps)
        if not victims:
            return False
        if victims[0] in protected:
            self.log.warning(victims[0], "evicted from memory although a peer's replica is at this step (memory "
                             "budget too small for memory_steps_retained + 2 slots): losing that peer now "
                             "resumes from an older step")
        else:
            self.log.warning(victims[0], "evicted from memory to make room (memory budget)")
        self.memory.delete(victims[0])
        return True

    def apply_retention(self, tier: Tier, policy: RetentionPolicy) -> list[int]:
        """Delete what ``policy`` selects in ``tier``; failures are logged, not raised.

        In the memory tier, steps the node agent protects (``tierckpt.protect``) are spared.
        """
        protected = read_protected(self.memory.ns_dir) if tier is self.memory else frozenset()
        try:
            victims = policy.select_for_deletion([s.step for s in tier.list_steps()], protected)
            for step in victims:
                tier.delete(step)
            return victims
        except StorageError as exc:
            self.log.warning(None, "retention on the %s tier failed: %s", tier.name, exc)
            return []

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        self.stager.close()
        self.pool.close()
        closer = getattr(self._durable, "close", None)
        if closer is not None:
            closer()


_RUNTIMES: dict[tuple[CheckpointConfig, int], RankRuntime] = {}
_RUNTIMES_LOCK = threading.Lock()


@atexit.register
def _close_runtimes() -> None:
    """The DCP plug-ins share process-wide runtimes: give their free slots back at exit."""
    with _RUNTIMES_LOCK:
        for rt in _RUNTIMES.values():
            rt.close()
        _RUNTIMES.clear()


def runtime_for(config: CheckpointConfig, rank: int) -> RankRuntime:
    """The process-wide runtime for ``(config, rank)``, created on first use."""
    with _RUNTIMES_LOCK:
        rt = _RUNTIMES.get((config, rank))
        if rt is None:
            rt = _RUNTIMES[(config, rank)] = RankRuntime(config, rank)
        return rt
