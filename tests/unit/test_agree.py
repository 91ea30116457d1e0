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


def test_steps_no_rank_set_can_load_raise_naming_who_holds_what() -> None:
    from tierckpt import NoUsableStepError

    files = {5: {"__0_0.distcp", "__1_0.distcp"}}  # ranks swapped nodes: each holds the other's file
    avail = [node(0, {5: {"__1_0.distcp"}}, all_files=files), node(1, {5: {"__0_0.distcp"}}, all_files=files)]
    with pytest.raises(NoUsableStepError) as info:
        choose_step(avail, None, namespace="n")
    err = info.value
    assert isinstance(err, CheckpointNotFoundError) and err.steps == (5,) and set(err.missing) == {5}
    assert "rank 0's memory tier holds step 5 (__1_0.distcp)" in str(err)
    assert "--replicas 1" in str(err) and "durable tier" in str(err)


def test_resume_before_takes_the_lowest_bound_of_any_rank() -> None:
    both = {"a", "b"}
    avail = [Availability(0, {s: F(both) for s in (2, 3, 4)}, {s: F(both) for s in (2, 3, 4)}, F(), {}, None, {}, 4),
             Availability(1, {s: F(both) for s in (2, 3, 4)}, {s: F(both) for s in (2, 3, 4)}, None, {}, None, {}, 3)]
    assert choose_step(avail, None, namespace="n").step == 2  # type: ignore[union-attr]
    assert choose_step(avail, 4, namespace="n").step == 4  # type: ignore[union-attr]  # explicit: unbounded
    low = [Availability(0, {4: F(both)}, {4: F(both)}, F(), {}, None, {}, 4)]
    assert choose_step(low, None, namespace="n") is None  # only steps at or after the bound: start over
