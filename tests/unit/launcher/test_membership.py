"""Membership of ``tierckpt run`` jobs: the pure parts (``membership.py``, ``offenders.py``) and
the spare gate on a real TCPStore (``spares.py``)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tierckpt.errors import ConfigError
from tierckpt.launcher.decide.escalation import EscalationPolicy, Fault
from tierckpt.launcher.decide.offenders import NodeFault, OffenderPolicy, attribute
from tierckpt.launcher.jobspec import RestartPolicy
from tierckpt.launcher.membership import ranks
from tierckpt.launcher.membership.change import (
    MEMBERSHIP_CHANGE,
    Change,
    Elastic,
    missing_nodes,
    prior_restarts,
    restart_history,
    shrink,
)
from tierckpt.launcher.membership.ranks import Claim
from tierckpt.launcher.membership.spares import (
    JobEnded,
    SpareGate,
    arrivals,
    finished,
    open_seats,
    publish_nodes,
    spares_waiting,
)


@pytest.fixture
def store(server: Any) -> Any:
    return server  # conftest.py: a real TCPStore


# ---- membership.Change ----

def test_change_names_the_spare_that_replaced_the_lost_node() -> None:
    c = Change(before={0: "a:/m", 1: "b:/m"}, after={0: "a:/m", 1: "c:/m"})
    assert c and (c.left, c.joined) == (["b:/m"], ["c:/m"])
    assert c.replaced == [{"node": 1, "left": "b:/m", "by": "c:/m"}]
    assert c.to_event() == {"nnodes_before": 2, "nnodes": 2, "left": ["b:/m"], "joined": ["c:/m"],
                            "replaced": [{"node": 1, "left": "b:/m", "by": "c:/m"}]}


def test_change_of_a_shrink_a_growth_and_of_nothing() -> None:
    shrunk = Change(before={0: "a", 1: "b", 2: "c"}, after={0: "a", 1: "c"})
    assert (shrunk.left, shrunk.joined, shrunk.replaced) == (["b"], [], [])
    grown = Change(before={0: "a"}, after={0: "a", 1: "b"})
    assert (grown.left, grown.joined, grown.replaced) == ([], ["b"], [])
    assert not Change(before={0: "a", 1: "b"}, after={1: "a", 0: "b"})  # same nodes, ranks swapped: no change
    assert not Change(before={}, after={0: "a"})  # the job's first round: nothing to compare with


def test_exchange_round_carries_the_survivors_view_of_the_last_round(store: Any) -> None:
    old = {0: "a", 1: "b"}
    store.set("tierckpt/rank-claim/1", Claim(prior=None, identity="c").to_json())  # the spare
    got = ranks.exchange_round(store, 0, 2, Claim(prior=0, survivor=True, identity="a", members=old))
    before, after = got.memberships()
    assert (got.rank, before, after) == (0, old, {0: "a", 1: "c"})
    assert got.digest == ranks.members_digest(after)  # the survivors' name for it in the next round
    assert Change(before=before, after=after).replaced == [{"node": 1, "left": "b", "by": "c"}]


# ---- elastic plans and restart counting ----

def test_elastic_parse_and_bad_values() -> None:
    assert Elastic.parse("2") == Elastic(2, 2) and not Elastic.parse("2").elastic
    assert Elastic.parse("1:3") == Elastic(1, 3) and Elastic.parse("1:3").elastic
    for bad in ("0:2", "3:2", "x"):
        with pytest.raises(ConfigError, match="--nnodes"):
            Elastic.parse(bad)


def test_shrink_regroups_only_with_min_survivors_and_no_spare() -> None:
    el = Elastic(2, 3)
    assert shrink(nnodes=3, lost=[1], elastic=el, spares_waiting=0).regroup
    assert shrink(nnodes=3, lost=[1], elastic=el, spares_waiting=0).survivors == (0, 2)
    assert not shrink(nnodes=3, lost=[1], elastic=el, spares_waiting=1).regroup  # the spare takes rank 1
    low = shrink(nnodes=2, lost=[1], elastic=el, spares_waiting=0)
    assert not low.regroup and "below the minimum" in low.why
    assert not shrink(nnodes=3, lost=[], elastic=el, spares_waiting=0).regroup


def _fault(gen: int, reason: str = "Crash", t: float = 0.0, step: int | None = None) -> Fault:
    return Fault(generation=gen, time=t, generation_started=t - 1000, reason=reason, first_beat=True,
                 step=step, resumed_step=None)


def test_membership_changes_cost_no_restart() -> None:
    claims = [_fault(3, "Crash", 1.0, 10), _fault(4, MEMBERSHIP_CHANGE, 2.0), _fault(5, "LostNode", 3.0, 30)]
    history = restart_history(claims)
    assert [f.reason for f in history] == ["Crash", "LostNode"]
    # 3 generations before this incarnation, one of them a membership change of an earlier one
    assert prior_restarts(claims, membership_changes_before=1) == 2
    policy = EscalationPolicy(job_max_retry_count=4)
    d = policy.decide(history, prior_restarts=prior_restarts(claims, 1))
    assert d.reason == "process restart 4 of 4"  # 2 before + 2 faults; the membership change is free
    with_change_counted = policy.decide(claims, prior_restarts=3)
    assert with_change_counted.action.value == "fail"  # what counting it would have done


def test_missing_nodes_per_reason() -> None:
    assert missing_nodes({"reason": "LostNode", "node": 1}, 3, 0) == 1
    assert missing_nodes({"reason": "LostNode", "node": 1, "lost": [1, 2]}, 3, 0) == 2
    assert missing_nodes({"reason": "Crash", "node": 0}, 3, 2) == 1  # one node missed the stop barrier
    assert missing_nodes({"reason": MEMBERSHIP_CHANGE}, 3, 1) == 0


# ---- the spare gate, on a real TCPStore ----

def test_gate_lets_an_agent_into_a_job_with_room_and_counts_it(store: Any) -> None:
    assert SpareGate(store, 2, lambda n: None).wait() is None  # no job yet: the first round
    assert arrivals(store) == 0
    publish_nodes(store, 1)
    ready = iter([False, False, True])
    assert SpareGate(store, 2, lambda n: None, ready=lambda: next(ready), poll_s=0.01).wait() is None
    assert arrivals(store) == 1  # counted once its standbys were ready


def test_gate_holds_a_spare_until_survivors_open_a_seat(store: Any) -> None:
    publish_nodes(store, 2)
    seen: list[int] = []
    out: list[float | None] = []
    warm: list[bool] = []
    t = threading.Thread(target=lambda: out.append(SpareGate(store, 2, seen.append, on_warm=lambda: warm.append(True),
                                                             poll_s=0.01).wait()))
    t0 = time.time()
    t.start()
    deadline = time.monotonic() + 5
    while spares_waiting(store) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [2] and spares_waiting(store) == 1 and t.is_alive()
    deadline = time.monotonic() + 5
    while not warm and time.monotonic() < deadline:
        time.sleep(0.01)
    assert warm == [True]  # reported once
    assert open_seats(store, 7, node=0, count=1)
    assert not open_seats(store, 7, node=1, count=1)  # the second survivor's call opens nothing more
    t.join(5)
    assert not t.is_alive() and out and out[0] is not None and out[0] >= t0
    assert spares_waiting(store) == 0


def test_gate_releases_a_spare_when_the_job_finishes(store: Any) -> None:
    publish_nodes(store, 2)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            SpareGate(store, 2, lambda n: None, poll_s=0.01).wait()
        except JobEnded as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)
    store.set("tierckpt/run/done/0", b"1")
    finished(store)  # both nodes passed their exit barrier (a spare that hosts the store waits for them)
    finished(store)
    t.join(5)
    assert errors and "finished" in str(errors[0])


# ---- repeat offenders ----

def test_repeat_offenders_within_the_window_worst_first() -> None:
    p = OffenderPolicy(max_avoid=1, window_s=100.0)
    faults = [NodeFault("a", 0.0), NodeFault("b", 150.0), NodeFault("a", 160.0), NodeFault("b", 170.0),
              NodeFault("a", 175.0), NodeFault("b", 180.0), NodeFault("c", 190.0)]
    assert p.offenders(faults) == ["b", "a"]  # a's first fault (t=0) is outside the window
    assert p.exclude(faults, spares=3) == ["b"]  # at most max_avoid
    assert OffenderPolicy(max_avoid=5, window_s=100.0).exclude(faults, spares=1) == ["b"]  # one spare
    assert p.exclude(faults, spares=0) == []  # no spare: the job is not shrunk to avoid a node
    assert OffenderPolicy(max_avoid=0).exclude(faults, spares=3) == []  # off
    assert OffenderPolicy(max_avoid=2, window_s=5.0).offenders(faults) == []  # nobody twice in 5 s


def test_offender_policy_from_the_job_file_and_bad_values() -> None:
    rsp = RestartPolicy(eval_period_s=3600.0, max_num_repeat_offenders_to_avoid=2)
    assert OffenderPolicy.from_restart_policy(rsp) == OffenderPolicy(max_avoid=2, window_s=3600.0)
    assert OffenderPolicy.from_restart_policy(None) == OffenderPolicy()
    with pytest.raises(ConfigError, match="maxNumRepeatOffendersToAvoid"):
        OffenderPolicy(max_avoid=-1)


def test_attribute_names_the_faulty_node_not_the_observers() -> None:
    claims = [{"reason": "Crash", "node": 1, "time": 1.0}, {"reason": MEMBERSHIP_CHANGE, "node": 0, "time": 2.0},
              {"reason": "LostNode", "node": 1, "time": 3.0}, {"reason": "LostStore", "node": None, "time": 4.0}]
    members = [{0: "a", 1: "b"}, {0: "a", 1: "b"}, {0: "a", 1: "c"}, {0: "a", 1: "c"}]
    assert attribute(claims, members) == [NodeFault("b", 1.0), NodeFault("c", 3.0)]
