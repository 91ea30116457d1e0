"""Resuming below a non-finite loss: the job-wide ``TIERCKPT_RESUME_BEFORE`` bound.

After a ``NonFiniteLoss`` fault at step N the newest checkpoint may hold weights the NaN already
reached, so every worker of the following generations gets ``TIERCKPT_RESUME_BEFORE=N`` and
``Checkpointer.load`` loads the newest step older than N. The bound stays until the job has
provably moved past N: during one later generation every node saw, on each of its local ranks,
only finite heartbeats and one at a step >= N. So a crash right after the NaN restart does not
reload the poisoned step. A NaN that repeats at the same step keeps the bound, and the NoProgress
rule (escalation.py) ends the job after a few such faults.

Call order (every agent; every node computes the same bound from the same store keys):
  1. ``_join``: ``offer(store, generation, bound)`` with the restart-state file's values before
     the join barrier, ``agreed(store, generation)`` after it (only a node whose file is current,
     i.e. names the generation about to start, offers a value, so a stale one cannot win).
  2. Every poll while a bound is set: ``moved_past(ranks, bound)``; the first True of a
     generation calls ``mark_past(store, generation)`` (once per node).
  3. After the stop barrier of generation g: ``advance(bound, fault, passed(store, g, nnodes))``
     is the bound of generation g + 1; it is saved in the restart-state file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tierckpt import workerenv
from tierckpt.launcher.control import keys

__all__ = ["ENV", "advance", "agreed", "mark_past", "moved_past", "offer", "passed"]

ENV = workerenv.RESUME_BEFORE  # the variable the bound travels in
NON_FINITE_LOSS = "NonFiniteLoss"


def advance(bound: int | None, fault: Mapping[str, Any], moved: bool, lowest: int | None = None) -> int | None:
    """The bound of the generation after ``fault``'s (pure).

    ``bound``: the bound its generation ran under; ``moved``: that generation moved past it on
    every node (``passed``); ``lowest``: the lowest non-finite step any node offered
    (``lowest_non_finite``). A non-finite loss at step N (the claim's, or ``lowest`` when lower)
    sets the bound to N (to the lower of the two when one is still set).
    """
    if bound is not None and moved:
        bound = None
    if fault.get("reason") == NON_FINITE_LOSS:
        step = fault.get("resume_before", fault.get("step"))
        if lowest is not None:
            step = min(step, lowest) if isinstance(step, int) else lowest
        if isinstance(step, int):
            bound = step if bound is None else min(bound, step)
    return bound


def moved_past(ranks: Iterable[tuple[int | None, bool]], bound: int) -> bool:
    """Every local rank, as ``(newest step, any non-finite beat this generation)``, beat finitely
    at a step >= ``bound`` (pure). No rank (nothing started) is not proof."""
    seen = list(ranks)
    return bool(seen) and all(step is not None and step >= bound and not bad for step, bad in seen)


def mark_past(store: Any, generation: int) -> None:
    store.add(keys.resume_past(generation), 1)


def passed(store: Any, generation: int, nnodes: int) -> bool:
    """Every node marked ``generation`` as past its bound (read after the stop barrier)."""
    return int(store.add(keys.resume_past(generation), 0)) >= nnodes


def offer_non_finite(store: Any, generation: int, step: int | None) -> None:
    """This node's lowest non-finite step of ``generation``, offered before its stop ack; the
    lowest offer of all nodes wins (the NaN rank's node sees it a step before the others, whose
    ranks get it through the all-reduce, and either may win the fault claim)."""
    if step is None:
        return
    key, expected = keys.resume_nonfinite(generation), b""
    while True:
        got = bytes(store.compare_set(key, expected, str(step).encode()))
        if int(got) <= step:
            return
        expected = got


def lowest_non_finite(store: Any, generation: int) -> int | None:
    """The lowest non-finite step any node offered for ``generation`` (read after the stop barrier)."""
    key = keys.resume_nonfinite(generation)
    return int(store.get(key)) if store.check([key]) else None


def offer(store: Any, generation: int, bound: int | None) -> None:
    """This node's bound for ``generation`` (from its restart-state file); the first offer wins."""
    if bound is not None:
        store.compare_set(keys.resume_bound(generation), b"", str(bound).encode())


def agreed(store: Any, generation: int) -> int | None:
    key = keys.resume_bound(generation)
    return int(store.get(key)) if store.check([key]) else None
