"""The recovery branches as a pure plan (launcher/decide/recovery.py), as a table: no process, no store."""

from __future__ import annotations

import pytest

from tierckpt.launcher.decide.escalation import Action, Decision
from tierckpt.launcher.decide.recovery import Step, after_stop, barrier_all

RESTART = Decision(Action.RESTART, 0.0, "process restart 1 of 3")
FULL = Decision(Action.FULL_RESTART, 0.0, "numRestartBeforeFullJobRestart (2) reached")
FAIL = Decision(Action.FAIL, 0.0, "jobMaxRetryCount (3) reached")


@pytest.mark.parametrize(("reason", "lost_now", "expected"), [
    ("Crash", [], True), ("Hang", [], True), ("NonFiniteLoss", [], True),
    ("LostNode", [], False), ("LostStore", [], False), ("MembershipChange", [], False),
    ("Crash", [2], False),  # a node counted lost meanwhile never acks
])
def test_the_stop_barrier_waits_for_every_node_only_when_every_node_can_ack(reason: str, lost_now: list[int],
                                                                           expected: bool) -> None:
    assert barrier_all(reason, lost_now) is expected


@pytest.mark.parametrize(("claim", "decision", "me", "all_here", "keep_out", "step", "kept_out", "forget"), [
    ({"reason": "Crash", "node": 1}, FULL, 0, True, (), Step.FINISH, 0, False),
    ({"reason": "Crash", "node": 1}, FAIL, 1, False, (1,), Step.FINISH, 0, False),
    ({"reason": "Crash", "node": 1}, RESTART, 0, True, (), Step.RESTART_IN_PLACE, 0, False),
    ({"reason": "Crash", "node": 1}, RESTART, 0, True, (1,), Step.RERENDEZVOUS, 1, False),  # the spare takes rank 1
    ({"reason": "Crash", "node": 1}, RESTART, 1, True, (1,), Step.STAND_ASIDE, 1, False),  # the offender
    ({"reason": "Crash", "node": 1}, RESTART, 0, False, (1,), Step.REGROUP, 0, False),  # kept-out needs everyone here
    ({"reason": "LostNode", "node": 1, "lost": [1]}, RESTART, 0, False, (), Step.REGROUP, 0, False),
    ({"reason": "LostNode", "node": 1, "lost": [1, 2]}, RESTART, 2, False, (), Step.REGROUP, 0, True),  # healed
    ({"reason": "LostNode", "node": 1}, RESTART, 1, False, (), Step.REGROUP, 0, True),
    ({"reason": "MembershipChange", "node": 0}, RESTART, 0, False, (), Step.REGROUP, 0, False),
])
def test_after_the_stop_each_node_takes_one_way(claim: dict[str, object], decision: Decision, me: int, all_here: bool,
                                                 keep_out: tuple[int, ...], step: Step, kept_out: int,
                                                 forget: bool) -> None:
    plan = after_stop(claim, decision, me=me, all_here=all_here, keep_out=keep_out)
    assert (plan.step, plan.kept_out, plan.forget_rank) == (step, kept_out, forget)
    assert plan.decision is decision
    assert plan.rendezvous is (step in (Step.STAND_ASIDE, Step.REGROUP, Step.RERENDEZVOUS))


def test_every_node_plans_the_same_membership_move_from_the_same_inputs() -> None:
    claim = {"reason": "Crash", "node": 2}
    plans = {me: after_stop(claim, RESTART, me=me, all_here=True, keep_out=(2,)) for me in range(4)}
    assert {me: p.step for me, p in plans.items()} == {0: Step.RERENDEZVOUS, 1: Step.RERENDEZVOUS,
                                                       2: Step.STAND_ASIDE, 3: Step.RERENDEZVOUS}
    assert {p.kept_out for p in plans.values()} == {1}


def test_the_master_port_is_free_and_below_the_ephemeral_range() -> None:
    """The workers' master store port: bindable now, and no outgoing connection can take it before
    rank 0 binds it (the kernel assigns those from ip_local_port_range)."""
    import socket

    from tierckpt.launcher.workers.runner import free_master_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = {free_master_port() for _ in range(5)}
    assert all(10000 <= p < low for p in ports), (ports, low)
    for p in ports:
        with socket.socket() as s:
            s.bind(("", p))
