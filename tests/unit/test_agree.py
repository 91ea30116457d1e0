from __future__ import annotations

import pytest

from tierckpt import CheckpointNotFoundError, IntegrityError
from tierckpt.dcp.agree import Availability, choose_step

F = frozenset


def node(rank: int, steps: dict[int, set[str]], all_files: dict[int, set[str]] | None = None, durable=None, bad=None):  # type: ignore[no-untyped-def]
    files = {s: F(all_files[s]) for s in steps} if all_files else {s: F(f) for s, f in steps.items()}
    return Availability(rank, {s: F(f) for s, f in steps.items()}, files, None if durable is None else F(durable), bad or {})


def test_nothing_anywhere() -> None:
    assert choose_step([node(0, {}), node(1, {})], None, namespace="n") is None


def test_newest_common_step() -> None:
    both = {"a", "b"}
    avail = [node(0, {3: both, 4: both}, durable=set()), node(1, {3: both})]
    choice = choose_step(avail, None, namespace="n")
    assert choice is not None and choice.step == 3 and choice.skipped[0][0] == 4


def test_durable_makes_a_step_loadable_for_a_node_that_lost_memory() -> None:
    avail = [node(0, {5: {"a"}}, all_files={5: {"a", "b"}}, durable={5}), node(1, {})]
    assert choose_step(avail, None, namespace="n").step == 5  # type: ignore[union-attr]


def test_memory_step_with_files_on_another_node_is_not_loadable() -> None:
    avail = [node(0, {6: {"a"}}, all_files={6: {"a", "b"}}, durable={4}), node(1, {6: {"b"}}, all_files={6: {"a", "b"}})]
    choice = choose_step(avail, None, namespace="n")
    assert choice is not None and choice.step == 4 and "cannot reach" in choice.skipped[0][1]


def test_explicit_step() -> None:
    avail = [node(0, {2: {"a"}}, durable={1})]
    assert choose_step(avail, 1, namespace="n").step == 1  # type: ignore[union-attr]
    with pytest.raises(CheckpointNotFoundError, match="step 9"):
        choose_step(avail, 9, namespace="n")


def test_bad_copies() -> None:
    avail = [node(0, {}, durable=set(), bad={7: "checksum"})]
    with pytest.raises(IntegrityError, match="step 7"):
        choose_step(avail, 7, namespace="n")
    with pytest.raises(IntegrityError, match="no step"):
        choose_step(avail, None, namespace="n")


def test_unreadable_durable_tier_is_not_reported_as_no_checkpoint() -> None:
    from tierckpt import StorageError

    avail = [Availability(0, {}, {}, frozenset(), {}, "connection refused")]
    with pytest.raises(StorageError, match="connection refused"):
        choose_step(avail, None, namespace="n")
    ok = [Availability(0, {4: F({"a"})}, {4: F({"a"})}, frozenset(), {}, "connection refused")]
    assert choose_step(ok, None, namespace="n").step == 4  # type: ignore[union-attr]
