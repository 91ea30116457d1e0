"""Which fault takes which path (launcher/inprocess/replace.py): replace alone, in-process, process (which
may end the job). Pure functions, the real ``EscalationPolicy``, and the agent's view of its
workers from real report files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierckpt.launcher.decide.escalation import Action, Decision, EscalationPolicy, Fault
from tierckpt.launcher.events import Events
from tierckpt.launcher.inprocess.replace import REPLACE, Route, route, tag
from tierckpt.launcher.inprocess.restarts import InProcessRestarts

RESTART = Decision(Action.RESTART, 0.0, "process restart 1")


def _crash(node: int = 1, **kw: object) -> dict[str, object]:
    return {"reason": "Crash", "node": node, "rank": node, "generation": 0, **kw}


def test_a_crash_is_tagged_only_when_replaceable_and_the_decision_restarts() -> None:
    tagged = tag(_crash(), replaceable=True, decision=RESTART)
    assert tagged["kind"] == REPLACE and tagged["delay_s"] == 0.0 and tagged["why"] == "process restart 1"
    assert "kind" not in tag(_crash(), replaceable=False, decision=RESTART), "a worker not under the wrapper"
    for action in (Action.FAIL, Action.FULL_RESTART):
        assert "kind" not in tag(_crash(), replaceable=True, decision=Decision(action, 0.0, "CrashLoop"))
    assert "kind" not in tag({"reason": "Hang", "node": 1}, replaceable=True, decision=RESTART), \
        "a live process is restarted in-process, not replaced"


@pytest.mark.parametrize(("fault", "node", "wrapped", "budget", "want"), [
    (_crash(kind=REPLACE), 1, True, True, Route.REPLACE),  # the dead rank's node
    (_crash(kind=REPLACE), 0, True, True, Route.INPROCESS),  # every other node
    (_crash(kind=REPLACE), None, True, True, Route.INPROCESS),
    (_crash(kind=REPLACE), 0, False, True, Route.PROCESS),  # that node's workers are not wrapped
    (_crash(kind=REPLACE), 1, True, False, Route.PROCESS),  # in-process restarts used up
    (_crash(), 1, True, True, Route.PROCESS),  # not tagged: the process path decides (and may end the job)
    ({"reason": "LostNode", "node": 1, "kind": REPLACE}, 0, True, True, Route.PROCESS),
    ({"reason": "LostStore"}, 0, True, True, Route.PROCESS),
    ({"reason": "MembershipChange"}, 0, True, True, Route.PROCESS),
    ({"reason": "FaultDeadline"}, 0, True, True, Route.PROCESS),
    ({"reason": "StartupDeadline"}, 0, True, True, Route.PROCESS),
    ({"reason": "Hang", "node": 1}, 0, True, True, Route.INPROCESS),
    ({"reason": "NonFiniteLoss", "node": 0}, 0, True, True, Route.INPROCESS),
    ({"reason": "Hang", "node": 1}, 0, False, True, Route.PROCESS),
    # a stopped process (SIGSTOP, a stopped debugger) cannot take an in-process restart: every node
    # waited the 30 s in-process timeout for it before the process path (found by the chaos soak)
    ({"reason": "Hang", "node": 1, "stopped": True}, 0, True, True, Route.PROCESS),
    ({"reason": "Hang", "node": 1, "stopped": True}, 1, True, True, Route.PROCESS),
])
def test_route(fault: dict[str, object], node: int | None, wrapped: bool, budget: bool, want: Route) -> None:
    assert route(fault, node=node, wrapped=wrapped, budget_left=budget) == want


def _fault(t: float, *, first_beat: bool, step: int | None = None) -> Fault:
    return Fault(generation=0, time=t, generation_started=t - 1.0, reason="Crash", first_beat=first_beat,
                 step=step, resumed_step=None)


def test_a_crash_loop_of_replaced_workers_is_not_replaced_again() -> None:
    """The same policy the process path applies: the third quick crash before a first beat fails."""
    pol = EscalationPolicy(crash_loop_limit=3, backoff_base_s=0.0)
    hist = [_fault(10.0 * i, first_beat=False) for i in range(1, 4)]
    assert tag(_crash(), replaceable=True, decision=pol.decide(hist[:2]))["kind"] == REPLACE
    third = pol.decide(hist)
    assert third.action == Action.FAIL and third.reason == "CrashLoop"
    assert "kind" not in tag(_crash(), replaceable=True, decision=third), "the process path ends the job"
    capped = EscalationPolicy(job_max_retry_count=1).decide([_fault(1.0, first_beat=True), _fault(9.0, first_beat=True)])
    assert "kind" not in tag(_crash(), replaceable=True, decision=capped)


def _write(d: Path, lr: int, **rec: object) -> None:
    with open(d / f"inproc_{lr}.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def test_workers_are_replaceable_only_all_ready_on_the_agent_store(tmp_path: Path) -> None:
    ev = Events(str(tmp_path / "ev.jsonl"), node=0)
    ip = InProcessRestarts(ev, max_restarts=2)
    ip.arm(str(tmp_path), [0, 1])
    assert not ip.replaceable
    _write(tmp_path, 0, event="ready", k=0, store="agent")
    _write(tmp_path, 1, event="ready", k=0, store="rank0")  # under plain torchrun's store: it dies with rank 0
    assert not ip.replaceable and ip.wrapped
    ip.arm(str(tmp_path / "g1"), [0, 1])
    (tmp_path / "g1").mkdir()
    for lr in (0, 1):
        _write(tmp_path / "g1", lr, event="ready", k=0, store="agent")
    assert ip.replaceable
    assert ip.handles(_crash(node=1, kind=REPLACE), node=0) and not ip.handles(_crash(node=1, kind=REPLACE), node=1)
    assert not ip.handles(_crash(node=1), node=0), "an untagged crash stops the processes"
    for k in (1, 2):  # two in-process generations done: the budget of 2 is used
        for lr in (0, 1):
            _write(tmp_path / "g1", lr, event="restart", k=k, rank=lr, reason="Crash", fault_time=0.0, stages_s={})
    assert not ip.replaceable and not ip.handles(_crash(node=1, kind=REPLACE), node=0)
    ev.close()


def test_a_replace_restart_waits_without_a_request_and_names_the_joined_rank(tmp_path: Path) -> None:
    ev = Events(str(tmp_path / "ev.jsonl"), node=1)
    ip = InProcessRestarts(ev, timeout_s=0.2)
    ip.arm(str(tmp_path), [0])
    _write(tmp_path, 0, event="restart", k=1, rank=1, reason="Crash", fault_time=0.0, stages_s={"barrier": 0.5},
           joined=True, replaced=True)
    assert ip.restart(0, "Crash", kind=REPLACE, since=1.0, rank=1, pid=42, warm=True) is not None
    assert not (tmp_path / "inproc_request").exists(), "the store's fault key is the request"
    ev.close()
    rec = [json.loads(x) for x in (tmp_path / "ev.jsonl").read_text().splitlines()][-1]
    assert rec["kind"] == REPLACE and rec["rank"] == 1 and rec["pid"] == 42 and rec["join_stages_s"] == {"barrier": 0.5}


def test_a_replaced_generation_finished_before_the_claim_is_read_belongs_to_the_claim(tmp_path: Path) -> None:
    """The replacement joined and every local rank reported k=1 before this agent read the claim:
    the poll leaves k=1 to the claim's restart, which takes it at once (it must not wait for k=2)."""
    ev = Events(str(tmp_path / "ev.jsonl"), node=0)
    ip = InProcessRestarts(ev, timeout_s=0.2)
    ip.arm(str(tmp_path), [0])
    _write(tmp_path, 0, event="ready", k=0, store="agent")
    _write(tmp_path, 0, event="restart", k=1, rank=0, reason="Crash", fault_time=0.0, stages_s={}, replaced=True)
    assert not ip.poll(0), "no in-process event of its own"
    assert ip.restart(0, "Crash", kind=REPLACE) is not None
    ev.close()
    recs = [json.loads(x) for x in (tmp_path / "ev.jsonl").read_text().splitlines()]
    assert [(e["event"], e["kind"], e["inprocess"]) for e in recs] == [("restart", REPLACE, 1)]
