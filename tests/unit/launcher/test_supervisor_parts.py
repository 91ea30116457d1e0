"""The supervisor's own parts without an agent: ``Ledger`` (restart accounting, the state file) on
a real in-memory store and a real state file, and ``Findings`` (one poll's evidence, diagnosis and
claim) on real beat files written by the workers' own writer (monitor.py). Process failures are
torch's ``ProcessFailure`` fields on a small dataclass: a dying process is what the scenario tiers test."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

from tierckpt import monitor, workerenv
from tierckpt.launcher.control.jobcontrol import JobControl
from tierckpt.launcher.decide.escalation import Action, EscalationPolicy
from tierckpt.launcher.detect.detectors import Detectors
from tierckpt.launcher.detect.heartbeat import HeartbeatPolicy
from tierckpt.launcher.events import Events
from tierckpt.launcher.inprocess.replace import REPLACE
from tierckpt.launcher.options import RunOptions
from tierckpt.launcher.supervisor.findings import Findings, View
from tierckpt.launcher.supervisor.ledger import Ledger, fault_of

_EVENTS: list[Events] = []


@pytest.fixture(autouse=True)
def _close_events() -> Iterator[None]:
    yield
    while _EVENTS:
        _EVENTS.pop().close()


def _claim(g: int, reason: str = "Crash", *, first_beat: bool = True, step: int | None = 5) -> dict[str, object]:
    return {"generation": g, "time": time.time(), "generation_started": time.time() - 1, "reason": reason,
            "first_beat": first_beat, "step": step, "resumed_step": 0, "node": 0, "rank": 0}


# ---- Ledger ----
def test_the_counts_and_the_decision_follow_the_claims(tmp_path: Path) -> None:
    led = Ledger(RunOptions(memory_dir=str(tmp_path), escalation=EscalationPolicy(job_max_retry_count=2)),
                 lambda: "job")
    claims = [fault_of(_claim(0)), fault_of(_claim(1, "MembershipChange"))]
    led.count(claims)
    assert (len(led.history), led.restarts, led.changes) == (1, 1, 1), "a membership change costs no restart"
    assert led.decide(claims, 1).action is Action.RESTART
    three = claims + [fault_of(_claim(2)), fault_of(_claim(3))]
    assert led.decide(three, 3).action is Action.FAIL, "past jobMaxRetryCount 2"
    assert led.decide(claims, 1) == led.decide(claims, 1), "the same on every node: same history, same seed"


def test_the_state_file_carries_the_counts_to_the_next_incarnation(tmp_path: Path) -> None:
    opts = RunOptions(memory_dir=str(tmp_path))
    led = Ledger(opts, lambda: "job")
    led.count([fault_of(_claim(0)), fault_of(_claim(1))])
    assert led.save(2, 1, hang={}, resume_before=7, offenses=[], avoid=[{"identity": "h:/m", "faults": 3}]) is None
    st = Ledger(opts, lambda: "job").load()
    assert (st.next_generation, st.full_restarts, st.restarts, st.resume_before) == (2, 1, 2, 7)
    assert st.job_started == pytest.approx(led.job_started)
    assert Ledger(RunOptions(memory_dir=str(tmp_path / "other")), lambda: "job").load().next_generation == 0


def test_every_node_agrees_on_the_largest_counts_whoever_offers_last(tmp_path: Path) -> None:
    store = dist.HashStore()
    opts = RunOptions(memory_dir=str(tmp_path))
    ledgers = [Ledger(opts, lambda: "job") for _ in range(2)]
    states = [Ledger(opts, lambda: "job").load(), Ledger(opts, lambda: "job").load()]
    from dataclasses import replace

    states = [replace(states[0], membership_changes=1, unhealthy_before=0),
              replace(states[1], membership_changes=4, unhealthy_before=2, job_started=100.0)]
    def one(i: int) -> None:  # the supervisor's order around the round's join barrier
        ctl = JobControl(store)
        if i == 1:
            time.sleep(0.3)  # the node that remembers more offers last
        ledgers[i].offer(states[i], ctl)
        _, full = ctl.join(dist.PrefixStore("round/", store), 2, local_next=0, local_full=3)
        ledgers[i].joined(states[i], ctl, full)

    threads = [threading.Thread(target=one, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for led in ledgers:
        assert (led.changes_before, led.unhealthy_before, led.full_restarts) == (4, 2, 3)
    assert ledgers[1].job_started == 100.0 and ledgers[0].job_started > 100.0


def test_a_crash_is_tagged_for_a_replacement_alone_when_the_decision_restarts(tmp_path: Path) -> None:
    store = dist.HashStore()
    led = Ledger(RunOptions(memory_dir=str(tmp_path)), lambda: "job")
    rec = led.tagged(dict(_claim(0)), 0, JobControl(store))
    assert rec["kind"] == REPLACE


def test_a_deadline_passes_only_when_one_is_set(tmp_path: Path) -> None:
    now = time.time()
    plain = Ledger(RunOptions(memory_dir=str(tmp_path)), lambda: "job")
    assert plain.deadline(now, generation_started=now, all_beat=lambda: pytest.fail("not read")) is None
    led = Ledger(RunOptions(memory_dir=str(tmp_path), escalation=EscalationPolicy(active_deadline_s=5.0)), lambda: "job")
    led.job_started = now - 10
    got = led.deadline(now, generation_started=now, all_beat=lambda: True)
    assert got is not None and "5" in got[1]


# ---- Findings ----
@dataclass
class _Failure:  # torch's ProcessFailure: the fields the detectors read
    exitcode: int
    pid: int
    local_rank: int


def _findings(tmp: Path) -> Findings:
    events = Events(str(tmp / "events.jsonl"), node=0, host="h")
    _EVENTS.append(events)
    return Findings(Detectors(HeartbeatPolicy(), [], str(tmp)), events, node_timeout_s=10.0)


def _view(**kw: object) -> View:
    base: dict[str, object] = dict(generation=3, node=1, nnodes=2, ranks={0: 2, 1: 3}, pids={})
    base.update(kw)
    return View(**base)  # type: ignore[arg-type]


def test_a_crash_becomes_one_claim_naming_its_rank_node_step_and_diagnosis(tmp_path: Path) -> None:
    f = _findings(tmp_path)
    f.arm([0, 1], ())
    writers = {lr: monitor._Writer(str(tmp_path / workerenv.beat_file(lr))) for lr in (0, 1)}
    for w in writers.values():
        w.write(6, 0.5)
    assert f.detect(RunResult(state=WorkerState.HEALTHY), _view(), None) is None
    f.woke(True)
    claim = f.detect(RunResult(state=WorkerState.FAILED, failures={3: _Failure(1, 99, 1)}), _view(), None)  # type: ignore[dict-item]
    assert claim is not None
    assert (claim["reason"], claim["rank"], claim["node"], claim["generation"], claim["step"]) == ("Crash", 3, 1, 3, 6)
    assert claim["first_beat"] is True and claim["resumed_step"] == 5
    assert claim["diagnosis"]["cause"] == "exited" and claim["detection_latency_s"] < 5


def test_a_non_finite_loss_is_claimed_at_its_first_step(tmp_path: Path) -> None:
    f = _findings(tmp_path)
    f.arm([0, 1], ())
    w0 = monitor._Writer(str(tmp_path / workerenv.beat_file(0)))
    w1 = monitor._Writer(str(tmp_path / workerenv.beat_file(1)))
    w0.write(1, 0.5)
    w1.write(1, float("nan"))
    w1.write(2, float("nan"))
    claim = f.detect(RunResult(state=WorkerState.HEALTHY), _view(), None)
    assert claim is not None and claim["reason"] == "NonFiniteLoss" and claim["rank"] == 3
    assert claim["step"] == claim["resume_before"] == 1


def test_a_deadline_and_an_arrival_are_claims_and_the_more_specific_wins(tmp_path: Path) -> None:
    f = _findings(tmp_path)
    f.arm([0, 1], ())
    arrival = f.detect(RunResult(state=WorkerState.HEALTHY), _view(arrival=True), None)
    assert arrival is not None and arrival["reason"] == "MembershipChange"
    both = f.detect(RunResult(state=WorkerState.HEALTHY),
                    _view(arrival=True, deadline=("DeadlineExceeded", "activeDeadlineSeconds 5 passed")), None)
    assert both is not None and both["reason"] == "DeadlineExceeded"
    assert sorted(e["reason"] for e in both["diagnosis"]["evidence"]) == ["DeadlineExceeded", "MembershipChange"]
