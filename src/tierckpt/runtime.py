"""What one rank keeps between saves: tiers, its slot pool, an I/O thread pool.

The seed's usage builds a new writer for every step, so the state that makes saves
cheap (open mappings of the shared-memory slots, an S3 client) cannot live in the
writer. ``runtime_for(config, rank)`` returns one ``RankRuntime`` per (config, rank) in
this process; ``Checkpointer`` owns and closes its own.
"""

from __future__ import annotations

import atexit
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from tierckpt import layout
from tierckpt.config import CheckpointConfig
from tierckpt.errors import StorageError
from tierckpt.node.budget import NodeBudget
from tierckpt.node.keep import read_protected
from tierckpt.node.sock import notify_committed
from tierckpt.observability import StepLogger
from tierckpt.policy import RetentionPolicy
from tierckpt.snapshot import Stager
from tierckpt.staging import SlotPool
from tierckpt.tiers import LocalTier, Tier, open_durable, open_memory
from tierckpt.tiers.peer import open_peer

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
        self.fallbacks = 0  #: saves the DCP plug-ins sent to the durable tier because the memory tier failed
        self.node_budget = NodeBudget(config.memory_dir, config.node_budget_bytes)
        self.pool = SlotPool(
            self.memory.ns_dir, rank,
            budget_bytes=config.memory_budget_bytes,
            evict=self.evict_for_room,
            gc=lambda: self.memory.gc_staging(keep=set(self.in_flight)),
            steps_retained=config.memory_steps_retained,
            node=self.node_budget,
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

    def evict_for_room(self, nbytes: int) -> bool:
        """Free memory for a slot of ``nbytes``; True if something went.

        Over the node budget the node agent evicts peer-cache copies and replicas first; then
        the oldest committed memory step goes that is not the newest and not in use (pinned),
        one with a durable or peer copy before one that exists only here. Steps the node agent
        protects (``tierckpt.node.keep``: a peer's replica is at them) go last, only when nothing
        else can (a save that finds no slot fails; the warning says so).
        """
        node = self.node_budget
        if node.limit() is not None and not node.fits(nbytes) and node.agent_make_room(nbytes):
            return True
        listed = [s.step for s in self.memory.list_steps()]
        protected = read_protected(self.memory.ns_dir)
        victims = RetentionPolicy.select_for_eviction(listed, busy=self._pinned_steps(), protected=protected)
        if len(victims) > 1:  # the order matters only with a choice: ask where copies are
            victims = RetentionPolicy.select_for_eviction(listed, copied=self._copied_elsewhere(victims),
                                                          busy=self._pinned_steps(), protected=protected)
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

    def _pinned_steps(self) -> set[int]:
        """Steps whose files a load or a durable copy holds a pin on (``LocalTier.pin``)."""
        out = set()
        try:
            names = os.listdir(self.memory.ns_dir / layout.PINS)
        except OSError:
            return set()
        for name in names:
            step = layout.parse_step_dir(name.split(".", 1)[0])
            if step is not None:
                out.add(step)
        return out

    def _copied_elsewhere(self, steps: list[int]) -> set[int]:
        """Those of ``steps`` whose data files here also exist in the durable tier or on a peer."""
        out: set[int] = set()
        try:
            if self.durable is not None:
                out |= {s.step for s in self.durable.list_steps()} & set(steps)
            peer = open_peer(self.config.memory_dir, self.config.namespace)
            rest = set(steps) - out
            if peer is not None and rest:
                held = peer.catalog()
                for listing in self.memory.list_steps():
                    ours = {n for n in listing.files if n.endswith(".distcp")}
                    theirs = held.get(listing.step)
                    if listing.step in rest and theirs is not None and ours and ours <= set(theirs.held):
                        out.add(listing.step)
        except StorageError as exc:
            self.log.warning(None, "could not tell which memory steps have other copies: %s", exc)
        return out

    def apply_retention(self, tier: Tier, policy: RetentionPolicy) -> list[int]:
        """Delete what ``policy`` selects in ``tier``; failures are logged, not raised.

        In the memory tier, steps the node agent protects (``tierckpt.node.keep``) are spared.
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
