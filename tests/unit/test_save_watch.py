"""``tierckpt.monitor``'s hold on saves after a non-finite loss (the rule; the gloo test is
tests/multiprocess/test_non_finite.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

import tierckpt.monitor as monitor


@pytest.fixture(autouse=True)
def _healthy() -> Iterator[None]:
    monitor.step(0, loss=1.0)  # the process-wide state starts finite
    yield
    monitor.step(0, loss=1.0)


def test_a_save_after_a_non_finite_loss_is_held_until_a_finite_one() -> None:
    monitor.step(5, loss=math.nan)
    held = monitor.watch_save(5)
    earlier_number = monitor.watch_save(3)  # whatever its number: made while the loss is non-finite
    assert held.reason() is not None and "non-finite at step 5" in held.reason()  # type: ignore[operator]
    assert earlier_number.reason() is not None
    monitor.step(6, loss=0.5)
    assert held.reason() is not None  # its state was taken while non-finite: still held
    assert monitor.watch_save(6).reason() is None
    for w in (held, earlier_number):
        w.close()


def test_a_non_finite_loss_arriving_before_the_commit_holds_saves_of_that_step_or_later() -> None:
    same, later, older = monitor.watch_save(7), monitor.watch_save(9), monitor.watch_save(6)
    monitor.step(7, loss=math.inf)
    assert "non-finite loss at step 7" in (same.reason() or "")
    assert later.reason() is not None
    assert older.reason() is None  # step 6 came before the loss went non-finite
    closed = monitor.watch_save(8)
    closed.close()
    for w in (same, later, older):
        w.close()


def test_non_finite_metrics_count_and_loss_none_does_not_clear() -> None:
    monitor.step(3, loss=0.1, grad_norm=math.nan)
    monitor.step(4)  # no loss: not evidence that training is finite again
    w = monitor.watch_save(4)
    assert w.reason() is not None
    w.close()

