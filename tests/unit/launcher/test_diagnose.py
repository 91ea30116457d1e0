"""The diagnosis stage (launcher/decide/diagnose.py), as a table: evidence in, one cause out."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tierckpt.launcher.decide.diagnose import SETTLE_S, SUSPECT_S, Poll, diagnose
from tierckpt.launcher.decide.faults import SPECIFICITY, FaultRecord, Kind, Reason, is_log_rule


def rec(kind: Kind, reason: str = "Crash", *, rank: int | None = 0, since: float | None = 10.0,
        symptom: str | None = None, node: int | None = None) -> FaultRecord:
    return FaultRecord(kind=kind, reason=reason, detail=f"{kind} of rank {rank}", rank=rank, since=since,
                       symptom=symptom, node=node, step=7)


RESET = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer"


def test_nothing_seen_is_nothing_to_claim() -> None:
    d = diagnose([], Poll(node=0, now=20.0))
    assert d.cause is None and d.held_since is None and d.evidence == ()


@pytest.mark.parametrize(("kinds", "winner"), [
    ((Kind.STALL, Kind.EXITED), Kind.EXITED),
    ((Kind.STALL, Kind.STOPPED), Kind.STOPPED),
    ((Kind.LOG_RULE, Kind.NON_FINITE), Kind.NON_FINITE),
    ((Kind.ARRIVAL, Kind.STALL), Kind.STALL),
    ((Kind.EXITED, Kind.KILLED), Kind.KILLED),
    ((Kind.EXITED, Kind.LOST_NODE), Kind.LOST_NODE),
    ((Kind.LOST_NODE, Kind.LOST_STORE), Kind.LOST_STORE),
    ((Kind.LOST_STORE, Kind.DEADLINE), Kind.DEADLINE),
])
def test_causes_rank_by_specificity(kinds: tuple[Kind, Kind], winner: Kind) -> None:
    d = diagnose([rec(k) for k in kinds], Poll(node=0, now=20.0))
    assert d.cause is not None and d.cause.kind is winner, d
    assert len(d.evidence) == 2 and str(winner) in d.why


def test_the_earliest_of_equal_causes_wins() -> None:
    late, early = rec(Kind.EXITED, rank=1, since=12.0), rec(Kind.EXITED, rank=0, since=11.0)
    assert diagnose([late, early], Poll(node=0, now=20.0)).cause == early


def test_a_failed_collective_waits_its_settle_window_for_a_cause() -> None:
    sym = rec(Kind.EXITED, rank=1, symptom=RESET, since=99.9)
    first = diagnose([sym], Poll(node=1, now=100.0))
    assert first.cause is None and first.held_since == 100.0
    again = replace(sym, since=102.0)  # later polls see the same crash (their own last poll's time)
    mid = diagnose([again], Poll(node=1, now=100.0 + SETTLE_S - 0.1, held_since=first.held_since))
    assert mid.cause is None and mid.held_since == 100.0
    last = diagnose([again], Poll(node=1, now=100.0 + SETTLE_S, held_since=mid.held_since))
    assert last.cause == replace(again, since=100.0) and last.settle_s == SETTLE_S and "settle window" in last.why
    assert last.cause.since == 100.0  # detected when first seen: the latency counts from then


def test_a_cause_seen_beside_a_symptom_is_claimed_at_once() -> None:
    sym, cause = rec(Kind.EXITED, rank=1, symptom=RESET), rec(Kind.KILLED, rank=0)
    d = diagnose([sym, cause], Poll(node=0, now=50.0))
    assert d.cause == cause and d.settle_s is None and "explained" in d.why


def test_a_symptom_and_a_silent_peer_blame_the_silent_node_not_the_observer() -> None:
    wait = rec(Kind.COLLECTIVE_WAIT, "Hang", rank=0, symptom="idle in a collective for 1.2s")
    d = diagnose([wait], Poll(node=0, now=30.0, quiet={1: SUSPECT_S + 0.2}))
    c = d.cause
    assert c is not None and c.kind is Kind.LOST_NODE and c.reason == Reason.LOST_NODE == "LostNode"
    assert (c.node, c.rank, c.lost) == (1, None, (1,)), c
    assert c.since == pytest.approx(30.0 - SUSPECT_S - 0.2) and c.symptom is None
    assert c.evidence["observed_by"] == 0 and c.evidence["silent_s"] == {"1": round(SUSPECT_S + 0.2, 3)}
    assert c.evidence["symptom"]["kind"] == "collective_wait" and "node 1 silent" in c.detail
    json.dumps(c.summary())  # the event carries it


def test_a_failed_collective_and_a_lost_node_blame_the_lost_node() -> None:
    d = diagnose([rec(Kind.EXITED, rank=0, symptom=RESET)], Poll(node=0, now=30.0, lost=(2,)))
    assert d.cause is not None and (d.cause.kind, d.cause.node, d.cause.lost) == (Kind.LOST_NODE, 2, (2,))
    assert d.cause.since == 10.0  # counted lost: its silence is unknown here, the symptom's time stands


def test_the_longest_silent_node_is_named_and_all_are_listed() -> None:
    wait = rec(Kind.COLLECTIVE_WAIT, "Hang", symptom="idle in a collective")
    c = diagnose([wait], Poll(node=1, now=9.0, quiet={0: 1.6, 2: 4.0, 3: 0.5})).cause
    assert c is not None and (c.node, c.lost) == (2, (0, 2))


@pytest.mark.parametrize("quiet", [{}, {1: SUSPECT_S - 0.01}, {0: 9.0}])  # none, not long enough, itself
def test_a_collective_wait_alone_is_no_fault(quiet: dict[int, float]) -> None:
    d = diagnose([rec(Kind.COLLECTIVE_WAIT, "Hang", symptom="idle in a collective")], Poll(node=0, now=5.0, quiet=quiet))
    assert d.cause is None and d.held_since is None


def test_a_deadlock_past_the_idle_limit_is_claimed_without_a_window() -> None:
    stall = rec(Kind.STALL, "Hang", symptom="idle in a collective for 5.1s")
    d = diagnose([stall], Poll(node=0, now=5.0))
    assert d.cause == stall and d.held_since is None


def test_a_lost_node_outranks_a_held_symptom_at_once() -> None:
    lost = FaultRecord(kind=Kind.LOST_NODE, reason="LostNode", detail="silent 10s", node=1, lost=(1,))
    d = diagnose([rec(Kind.EXITED, symptom=RESET), lost], Poll(node=0, now=5.0, held_since=4.0))
    assert d.cause == lost


def test_records_are_typed_and_frozen() -> None:
    with pytest.raises(TypeError):
        FaultRecord(kind="exited", reason="Crash", detail="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        FaultRecord(kind=Kind.EXITED, reason="", detail="x")
    r = rec(Kind.EXITED)
    with pytest.raises(AttributeError):
        r.node = 3  # type: ignore[misc]
    assert r.summary() == {"kind": "exited", "reason": "Crash", "detail": "exited of rank 0", "rank": 0, "step": 7}
    assert list(SPECIFICITY) == list(dict.fromkeys(SPECIFICITY)) and set(SPECIFICITY) == set(Kind)
    assert is_log_rule("LogHang_loss") and not is_log_rule("Hang")
    assert str(Reason.HANG) == "Hang" and str(Kind.STALL) == "stall"


def test_the_same_evidence_gives_the_same_answer() -> None:
    ev = [rec(Kind.STALL, "Hang", rank=3), rec(Kind.EXITED, rank=2, symptom=RESET), rec(Kind.NON_FINITE, "NonFiniteLoss")]
    p = Poll(node=0, now=42.0, quiet={1: 0.4})
    assert diagnose(ev, p) == diagnose(list(reversed(ev)), p)


def test_a_failed_collective_gives_a_slow_peer_agent_longer_than_a_collective_wait() -> None:
    """A crash symptom names a silent peer only after CRASH_SUSPECT_S (its agent may be stopped or
    starved, about to claim its own worker's crash); a rank idle in a collective after SUSPECT_S."""
    from tierckpt.launcher.decide.diagnose import CRASH_SUSPECT_S

    crash = rec(Kind.EXITED, rank=0, symptom=RESET)
    held = diagnose([crash], Poll(node=0, now=50.0, quiet={1: CRASH_SUSPECT_S - 0.1}))
    assert held.cause is None and held.held_since == 50.0
    lost = diagnose([crash], Poll(node=0, now=50.5, quiet={1: CRASH_SUSPECT_S}, held_since=50.0)).cause
    assert lost is not None and (lost.kind, lost.node) == (Kind.LOST_NODE, 1)
    wait = rec(Kind.COLLECTIVE_WAIT, "Hang", symptom="waits in a collective")
    both = diagnose([crash, wait], Poll(node=0, now=50.0, quiet={1: SUSPECT_S}))
    assert both.cause is not None and both.cause.kind is Kind.LOST_NODE
    assert SUSPECT_S < CRASH_SUSPECT_S < SETTLE_S  # a lost machine is still named within the window
