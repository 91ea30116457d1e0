"""The durable drain queue: copies of committed memory steps to the durable tier, in order.

Call order (every rank, same order): the committer thread calls ``DrainQueue.submit`` after
a step is committed in memory; one drain thread copies this rank's files (``tiers/copy.py``,
pinned so retention cannot recycle their slots), all ranks agree on the outcome over ``drain_group``,
then rank 0 (every rank in local mode) commits the step durably and applies retention.
``close`` waits for queued copies and stops the thread.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tierckpt import metrics
from tierckpt.errors import DurableWriteError
from tierckpt.observability import StepLogger, throughput
from tierckpt.runtime import RankRuntime
from tierckpt.tiers.copy import commit_step, pin_files, put_files, release_pins

__all__ = ["DrainQueue"]


class DrainQueue:
    """At most one durable copy running and one queued, per rank."""

    def __init__(self, runtime: RankRuntime, log: StepLogger, *, rank: int, world_size: int,
                 group: Any, coordinator: bool) -> None:
        self.runtime = runtime
        self.log = log
        self.rank = rank
        self.world_size = world_size
        self.group = group  # a gloo group of its own, or None (one process / local mode)
        self.coordinator = coordinator  # this rank commits the durable copy
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tierckpt-drain")
        self._drains: list[Future[None]] = []  # running or queued durable copies, oldest first

    def submit(self, step: int, save_id: str, files: list[str], small: tuple[bytes, bytes] | None) -> Future[None]:
        """Queue the durable copy of a step committed in memory (committer thread only)."""
        self._bound(step)
        pins = pin_files(self.runtime.memory, step, files)  # retention cannot recycle their slots meanwhile
        future = self._executor.submit(self._drain, step, save_id, pins, small)
        self._drains.append(future)
        return future

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def _bound(self, step: int) -> None:
        """Back-pressure: at most one durable copy running and one queued.

        Each queued copy pins a whole slot, so an unbounded queue behind a slow durable
        tier would grow shared memory by one step per save. Waiting here holds up the next
        save, identically on every rank (dropping queued copies instead could differ between
        ranks, whose drains run collectives together).
        """
        self._drains = [f for f in self._drains if not f.done()]
        if len(self._drains) >= 2:
            self.log.warning(step, "durable tier slower than saves: waiting for the copy of an earlier "
                             "step (raise durable_every_n_steps to avoid this stall)")
            while len(self._drains) >= 2:
                self._drains[0].exception()
                self._drains = [f for f in self._drains if not f.done()]

    def _copy_files(self, step: int, save_id: str, pins: dict[str, Path | None]) -> int:
        """This rank's files to the durable tier; returns its share of the bytes."""
        try:
            durable = self.runtime.durable
            if durable is None:
                raise DurableWriteError(f"step {step}: no durable tier is configured", tier="durable", step=step)
        except BaseException:
            release_pins(pins)
            raise
        return put_files(durable, step, save_id, pins)

    def _drain(self, step: int, save_id: str, pins: dict[str, Path | None], small: tuple[bytes, bytes] | None) -> None:
        rt = self.runtime
        error: str | None = None
        cause: BaseException | None = None
        t0 = time.perf_counter()
        nbytes = 0
        try:
            nbytes = self._copy_files(step, save_id, pins)
        except Exception as exc:  # every rank must reach the agreement below; the cause is chained
            error, cause = f"rank {self.rank}: {exc}", exc
        errors = [error]
        if self.group is not None:
            errors = [None] * self.world_size
            dist.all_gather_object(errors, error, group=self.group)
        failed = [e for e in errors if e]
        durable = rt.durable
        if not failed and self.coordinator and durable is not None:
            try:
                if small is None:
                    raise DurableWriteError(f"step {step}: no metadata to commit", tier="durable", step=step)
                commit_step(durable, step, save_id, small[0], small[1])
                rt.apply_retention(durable, rt.durable_retention)
            except Exception as exc:  # the other ranks wait in the broadcast below; chained
                failed, cause = [f"commit: {exc}"], exc
        if self.group is not None:
            box = [failed]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
            failed = box[0]
        if failed or durable is None:
            metrics.durable_failed(self.runtime, step)
            self.log.warning(step, "durable copy failed: %s", "; ".join(failed))
            raise DurableWriteError(
                f"durable copy of step {step} failed (its memory copy is intact): " + "; ".join(failed),
                tier="durable", step=step,
            ) from cause
        metrics.durable_committed(self.runtime, step, nbytes, time.perf_counter() - t0)
        self.log.info(step, "Durable write completed in %s (%s)", throughput(nbytes, time.perf_counter() - t0),
                      durable.location(step))
