"""What ``Checkpointer`` hands back: the handle of one save, and the steps it can see."""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

__all__ = ["SaveHandle", "StepInfo"]


@dataclass(frozen=True)
class StepInfo:
    """A step and the tiers (as this rank sees them) that hold a committed copy."""

    step: int
    tiers: frozenset[str]


class SaveHandle:
    """The result of ``Checkpointer.save``: staged, then in memory, then durable when asked.

    Three stages, each a future: ``wait_staged()`` (the state is copied out of the caller's
    tensors: they may change now), ``memory_committed()`` and ``result()`` / ``wait()`` (done
    everywhere it was asked to go). A blocking save returns already staged; an overlapped
    save (``overlap=True``) returns before. ``skipped`` is the reason the step was not committed
    although nothing failed (a non-finite loss reported by ``tierckpt.monitor.step`` before the
    commit); the stages then finish without error.
    """

    def __init__(self, step: int, durable: bool, blocking_s: float) -> None:
        self.step = step
        self.durable = durable
        self.blocking_s = blocking_s  #: seconds ``save`` blocked (the copy, or only its start when overlapped)
        self._staged: Future[None] = Future()
        self._memory: Future[None] = Future()
        self._future: Future[None] = Future()
        self.skipped: str | None = None  #: why the step was not committed (a non-finite loss), or None
        #: the memory tier failed ('no_space', 'unwritable', 'error'; 'other_rank': another rank's did):
        #: the step went to the durable tier only
        self.fallback: str | None = None

    @property
    def staged(self) -> bool:
        """True once the state is copied out: the caller may change its tensors now."""
        return self._staged.done() and self._staged.exception() is None

    def wait_staged(self, timeout: float | None = None) -> None:
        """Wait until the state is copied out of the caller's tensors; re-raise a copy failure."""
        self._staged.result(timeout)

    def memory_committed(self, timeout: float | None = None) -> None:
        """Wait until the step is committed in the memory tier; re-raise a failure."""
        self._memory.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> None:
        """Wait for the save to finish everywhere it was asked to go; re-raise its error."""
        self._future.result(timeout)

    wait = result

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def _skip(self, reason: str) -> None:
        """Finish every stage without committing (committer thread): ``skipped`` says why."""
        self.skipped = reason
        for future in (self._staged, self._memory, self._future):
            settle(future)

    def _fail(self, exc: BaseException) -> None:
        """Record a failure on every stage not yet finished (committer thread)."""
        for future in (self._staged, self._memory, self._future):
            settle(future, exc)


def settle(future: Future[None], exc: BaseException | None = None) -> None:
    """Finish ``future`` unless another thread already did (the copy thread and the committer race)."""
    try:
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)
    except InvalidStateError:
        pass
