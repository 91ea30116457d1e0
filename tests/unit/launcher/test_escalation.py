from __future__ import annotations

import itertools
from typing import Any

import pytest

from tierckpt.errors import ConfigError, ProtocolError
from tierckpt.launcher.decide.escalation import Action, Decision, EscalationPolicy, Fault
from tierckpt.launcher.jobspec import RestartPolicy, RunPolicy

T0 = 1_700_000_000.0
NO_JITTER: dict[str, Any] = {"backoff_jitter": 0.0}


def fault(
    generation: int,
    *,
    time: float | None = None,
    lived: float = 1000.0,
    first_beat: bool = True,
    step: int | None = None,
    resumed_step: int | None = None,
    reason: str = "Crash",
) -> Fault:
    t = T0 + 10_000 * generation if time is None else time
    return Fault(
        generation=generation,
        time=t,
        generation_started=t - lived,
        reason=reason,
        first_beat=first_beat,
        step=step,
        resumed_step=resumed_step,
    )


def progressing(n: int, **kw: Any) -> list[Fault]:
    """n faults of generations that each ran stably and advanced 100 steps."""
    return [fault(g, step=100 * (g + 1), resumed_step=100 * g if g else None, **kw) for g in range(n)]


# --- plain restarts ----------------------------------------------------------------------------


def test_default_policy_restarts_forever() -> None:
    policy = EscalationPolicy()
    history = progressing(50)
    for n in range(1, 51):
        decision = policy.decide(history[:n])
        assert decision.action is Action.RESTART
        assert decision.reason == f"process restart {n}"
        assert decision.delay_s == 0.0  # every generation ran stably


def test_restart_reason_counts_against_job_max_retry_count() -> None:
    policy = EscalationPolicy(job_max_retry_count=5)
    decision = policy.decide(progressing(2))
    assert decision == Decision(Action.RESTART, 0.0, "process restart 2 of 5", "after Crash")


def test_decide_needs_a_fault() -> None:
    with pytest.raises(ProtocolError, match="last entry of history"):
        EscalationPolicy().decide([])


def test_action_values() -> None:
    assert [a.value for a in Action] == ["restart", "full_restart", "fail"]
    assert Action("full_restart") is Action.FULL_RESTART


# --- jobMaxRetryCount --------------------------------------------------------------------------


def test_job_max_retry_count_allows_exactly_that_many_restarts() -> None:
    policy = EscalationPolicy(job_max_retry_count=3)
    history = progressing(4)
    assert [policy.decide(history[:n]).action for n in (1, 2, 3)] == [Action.RESTART] * 3
    decision = policy.decide(history)
    assert decision.action is Action.FAIL
    assert decision.reason == "jobMaxRetryCount (3) reached"
    assert decision.delay_s == 0.0
    assert "3 restart(s) done" in decision.detail and "raise jobMaxRetryCount" in decision.detail


def test_job_max_retry_count_zero_fails_the_first_fault() -> None:
    decision = EscalationPolicy(job_max_retry_count=0).decide(progressing(1))
    assert (decision.action, decision.reason) == (Action.FAIL, "jobMaxRetryCount (0) reached")


def test_prior_restarts_count_toward_job_max_retry_count() -> None:
    policy = EscalationPolicy(job_max_retry_count=3)
    assert policy.decide(progressing(1), prior_restarts=2).reason == "process restart 3 of 3"
    assert policy.decide(progressing(1), prior_restarts=3).action is Action.FAIL


# --- numRestartBeforeFullJobRestart / evalPeriodSeconds / maxFullJobRestarts ---------------------


def _windowed(**kw: Any) -> EscalationPolicy:
    return EscalationPolicy(num_restart_before_full_job_restart=2, eval_period_s=3600.0, **kw)


def test_full_restart_after_n_restarts_in_window() -> None:
    policy = _windowed()
    history = [fault(g, time=T0 + 1000 * g, lived=500.0, step=10 * (g + 1)) for g in range(3)]
    assert policy.decide(history[:1]).action is Action.RESTART
    assert policy.decide(history[:2]).action is Action.RESTART
    decision = policy.decide(history)
    assert decision.action is Action.FULL_RESTART
    assert decision.reason == "numRestartBeforeFullJobRestart (2) reached within evalPeriodSeconds (3600)"
    assert decision.detail == "3 faults within evalPeriodSeconds (3600); full job restart 1"


def test_faults_outside_the_window_do_not_count() -> None:
    policy = _windowed()
    history = [
        fault(0, time=T0, step=10),
        fault(1, time=T0 + 1000, step=20),
        fault(2, time=T0 + 3601, step=30),  # the first fault is now 3601 s old
    ]
    assert policy.decide(history).action is Action.RESTART
    edge = [*history[:2], fault(2, time=T0 + 3600, step=30)]  # window is inclusive
    assert policy.decide(edge).action is Action.FULL_RESTART


def test_zero_restarts_before_full_restart() -> None:
    decision = EscalationPolicy(num_restart_before_full_job_restart=0, eval_period_s=60).decide(
        progressing(1)
    )
    assert decision.action is Action.FULL_RESTART


def test_without_eval_period_the_window_is_all_history() -> None:
    policy = EscalationPolicy(num_restart_before_full_job_restart=2)
    history = progressing(3)  # 10 000 s apart
    decision = policy.decide(history)
    assert decision.action is Action.FULL_RESTART
    assert decision.reason == "numRestartBeforeFullJobRestart (2) reached in this run"


def test_max_full_job_restarts() -> None:
    policy = _windowed(max_full_job_restarts=1)
    history = [fault(g, time=T0 + 100 * g, lived=500.0, step=10 * (g + 1)) for g in range(3)]
    first = policy.decide(history, full_restarts=0)
    assert first.action is Action.FULL_RESTART
    assert first.detail.endswith("full job restart 1 of 1")
    decision = policy.decide(history, full_restarts=1)
    assert decision.action is Action.FAIL
    assert decision.reason == "maxFullJobRestarts (1) reached"
    assert decision.delay_s == 0.0
    assert "raise maxFullJobRestarts" in decision.detail


def test_max_full_job_restarts_zero_fails_instead_of_full_restart() -> None:
    policy = _windowed(max_full_job_restarts=0)
    history = [fault(g, time=T0 + 100 * g, lived=500.0, step=10 * (g + 1)) for g in range(3)]
    assert policy.decide(history[:2]).action is Action.RESTART
    assert policy.decide(history).reason == "maxFullJobRestarts (0) reached"


def test_job_max_retry_count_wins_over_full_restart() -> None:
    policy = _windowed(job_max_retry_count=2)
    history = [fault(g, time=T0 + 100 * g, lived=500.0, step=10 * (g + 1)) for g in range(3)]
    assert policy.decide(history).reason == "jobMaxRetryCount (2) reached"


# --- backoff -----------------------------------------------------------------------------------


def test_backoff_doubles_for_consecutive_quick_faults() -> None:
    policy = EscalationPolicy(
        backoff_base_s=1.0, backoff_max_s=60.0, crash_loop_limit=0, no_progress_limit=0, **NO_JITTER
    )
    history = [fault(g, lived=5.0) for g in range(10)]
    delays = [policy.decide(history[:n]).delay_s for n in range(1, 11)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]


def test_stable_run_resets_backoff() -> None:
    policy = EscalationPolicy(stable_after_s=120.0, crash_loop_limit=0, **NO_JITTER)
    history = [
        fault(0, lived=5.0),
        fault(1, lived=5.0),
        fault(2, lived=5.0),
        fault(3, lived=120.0),  # ran stably: the fault after a stable run restarts at once
        fault(4, lived=5.0),
        fault(5, lived=5.0),
    ]
    delays = [policy.decide(history[:n]).delay_s for n in range(1, 7)]
    assert delays == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]
    assert policy.consecutive_quick(history) == 2
    assert policy.consecutive_quick(history[:4]) == 0


def test_first_fault_restarts_at_once_even_if_quick() -> None:
    assert EscalationPolicy(**NO_JITTER).decide([fault(0, lived=0.5)]).delay_s == 0.0


def test_full_restart_gets_backoff_too() -> None:
    policy = EscalationPolicy(
        num_restart_before_full_job_restart=1, eval_period_s=3600, crash_loop_limit=0, **NO_JITTER
    )
    history = [fault(0, time=T0, lived=5.0), fault(1, time=T0 + 10, lived=5.0)]
    decision = policy.decide(history)
    assert (decision.action, decision.delay_s) == (Action.FULL_RESTART, 1.0)


def test_backoff_delay_values() -> None:
    policy = EscalationPolicy(backoff_base_s=0.5, backoff_max_s=10.0, **NO_JITTER)
    assert [policy.backoff_delay(k, seed=0) for k in range(-1, 8)] == [
        0.0,
        0.0,
        0.5,
        1.0,
        2.0,
        4.0,
        8.0,
        10.0,
        10.0,
    ]
    assert policy.backoff_delay(10_000, seed=0) == 10.0  # no overflow


def test_backoff_jitter_is_bounded_deterministic_and_seeded() -> None:
    policy = EscalationPolicy(backoff_base_s=4.0, backoff_max_s=1000.0, backoff_jitter=0.25)
    for k, seed in itertools.product(range(1, 6), range(50)):
        raw = 4.0 * 2 ** (k - 1)
        delay = policy.backoff_delay(k, seed)
        assert raw * 0.75 <= delay <= raw * 1.25
        assert delay == policy.backoff_delay(k, seed)
    assert len({policy.backoff_delay(3, seed) for seed in range(50)}) > 40


def test_jittered_backoff_never_exceeds_the_cap() -> None:
    policy = EscalationPolicy(backoff_base_s=1.0, backoff_max_s=8.0, backoff_jitter=0.5)
    delays = [policy.backoff_delay(k, seed) for k in range(4, 10) for seed in range(30)]
    assert max(delays) <= 8.0
    assert min(delays) >= 4.0


def test_decide_is_deterministic_across_instances() -> None:
    history = [fault(g, lived=5.0) for g in range(4)]
    a = EscalationPolicy(crash_loop_limit=0).decide(history, seed=1234)
    b = EscalationPolicy(crash_loop_limit=0).decide(list(history), seed=1234)
    assert a == b and a.delay_s > 0
    c = EscalationPolicy(crash_loop_limit=0).decide(history, seed=99)
    assert c.delay_s != a.delay_s


def test_zero_base_means_no_backoff() -> None:
    policy = EscalationPolicy(backoff_base_s=0.0, crash_loop_limit=0)
    assert policy.decide([fault(g, lived=1.0) for g in range(5)]).delay_s == 0.0


# --- CrashLoop ---------------------------------------------------------------------------------


def test_crash_loop_after_three_deaths_before_first_beat() -> None:
    policy = EscalationPolicy()
    history = [fault(g, lived=3.0, first_beat=False, reason="Crash") for g in range(3)]
    assert policy.decide(history[:2]).action is Action.RESTART
    decision = policy.decide(history)
    assert (decision.action, decision.reason, decision.delay_s) == (Action.FAIL, "CrashLoop", 0.0)
    assert "3 generations in a row died before every worker's first heartbeat" in decision.detail
    assert "fix the startup error" in decision.detail


@pytest.mark.parametrize(
    "breaker",
    [
        {"first_beat": True, "lived": 3.0},  # it got to its first beat
        {"first_beat": False, "lived": 500.0},  # it lived past stable_after_s
    ],
)
def test_crash_loop_needs_consecutive_startup_deaths(breaker: dict[str, Any]) -> None:
    policy = EscalationPolicy()
    history = [
        fault(0, lived=3.0, first_beat=False),
        fault(1, lived=3.0, first_beat=False),
        fault(2, **breaker),
        fault(3, lived=3.0, first_beat=False),
        fault(4, lived=3.0, first_beat=False),
    ]
    assert policy.decide(history).action is Action.RESTART
    assert policy.decide([*history, fault(5, lived=3.0, first_beat=False)]).reason == "CrashLoop"


def test_crash_loop_limit_is_configurable_and_can_be_off() -> None:
    history = [fault(g, lived=3.0, first_beat=False) for g in range(5)]
    assert EscalationPolicy(crash_loop_limit=1).decide(history[:1]).reason == "CrashLoop"
    assert EscalationPolicy(crash_loop_limit=5).decide(history[:4]).action is Action.RESTART
    assert EscalationPolicy(crash_loop_limit=5).decide(history).reason == "CrashLoop"
    assert EscalationPolicy(crash_loop_limit=0).decide(history).action is Action.RESTART


def test_crash_loop_wins_over_job_max_retry_count() -> None:
    history = [fault(g, lived=3.0, first_beat=False) for g in range(3)]
    assert EscalationPolicy(job_max_retry_count=2).decide(history).reason == "CrashLoop"


# --- NoProgress --------------------------------------------------------------------------------


def test_no_progress_after_three_faults_at_the_same_step() -> None:
    policy = EscalationPolicy()
    history = [
        fault(0, step=150, resumed_step=None),  # fresh start, got to 150: progress
        fault(1, step=150, resumed_step=100),  # resumed at 100, died at 150 again
        fault(2, step=150, resumed_step=100),
        fault(3, step=120, resumed_step=100),
    ]
    assert policy.decide(history[:3]).action is Action.RESTART
    decision = policy.decide(history)
    assert (decision.action, decision.reason) == (Action.FAIL, "NoProgress")
    assert "3 faults in a row without getting past step 120" in decision.detail


def test_dying_at_the_resumed_step_is_no_progress() -> None:
    policy = EscalationPolicy()
    history = [fault(g, step=100, resumed_step=100) for g in range(3)]
    assert policy.decide(history).reason == "NoProgress"


def test_steady_progress_never_trips_no_progress() -> None:
    policy = EscalationPolicy()
    history = progressing(20)
    assert all(policy.decide(history[:n]).action is Action.RESTART for n in range(1, 21))


def test_unknown_step_ends_the_no_progress_run() -> None:
    policy = EscalationPolicy()
    history = [
        fault(0, step=100, resumed_step=100),
        fault(1, step=100, resumed_step=100),
        fault(2, step=None, resumed_step=100),
        fault(3, step=100, resumed_step=100),
        fault(4, step=100, resumed_step=100),
    ]
    assert policy.decide(history).action is Action.RESTART


def test_no_baseline_counts_as_progress() -> None:
    policy = EscalationPolicy(no_progress_limit=1)
    assert policy.decide([fault(0, step=0, resumed_step=None)]).action is Action.RESTART
    assert policy.decide([fault(0, step=5, resumed_step=5)]).reason == "NoProgress"


def test_no_progress_limit_off() -> None:
    history = [fault(g, step=100, resumed_step=100) for g in range(10)]
    assert EscalationPolicy(no_progress_limit=0).decide(history).action is Action.RESTART


# --- construction ------------------------------------------------------------------------------


def test_from_run_policy() -> None:
    rp = RunPolicy(
        job_max_retry_count=10,
        restart_policy=RestartPolicy(
            num_restart_before_full_job_restart=3,
            eval_period_s=21600.0,
            max_full_job_restarts=1,
            max_num_repeat_offenders_to_avoid=2,
        ),
    )
    policy = EscalationPolicy.from_run_policy(rp, backoff_max_s=30.0)
    assert policy == EscalationPolicy(
        job_max_retry_count=10,
        num_restart_before_full_job_restart=3,
        eval_period_s=21600.0,
        max_full_job_restarts=1,
        backoff_max_s=30.0,
    )
    assert EscalationPolicy.from_run_policy(RunPolicy()) == EscalationPolicy()


def test_from_run_policy_overrides_beat_the_file() -> None:
    rp = RunPolicy(job_max_retry_count=10)
    assert EscalationPolicy.from_run_policy(rp, job_max_retry_count=2).job_max_retry_count == 2


def test_from_run_policy_rejects_unknown_overrides() -> None:
    with pytest.raises(
        ConfigError, match="unknown escalation setting.*backof_max_s; known: job_max_retry_count"
    ):
        EscalationPolicy.from_run_policy(RunPolicy(), backof_max_s=3)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"job_max_retry_count": -1}, "escalation.job_max_retry_count must be a whole number >= 0"),
        ({"num_restart_before_full_job_restart": 1.5}, "num_restart_before_full_job_restart must be a whole"),
        ({"max_full_job_restarts": True}, "max_full_job_restarts must be a whole number"),
        ({"crash_loop_limit": -1}, "crash_loop_limit must be"),
        ({"no_progress_limit": -2}, "no_progress_limit must be"),
        ({"backoff_base_s": -1.0}, "backoff_base_s must be a finite number of seconds >= 0"),
        ({"stable_after_s": float("nan")}, "stable_after_s must be a finite"),
        ({"backoff_max_s": float("inf")}, "backoff_max_s must be a finite"),
        ({"eval_period_s": 0.0}, "eval_period_s must be more than zero"),
        (
            {"backoff_base_s": 10.0, "backoff_max_s": 5.0},
            r"backoff_max_s \(5.0\) is below backoff_base_s \(10.0\)",
        ),
        ({"backoff_jitter": 1.0}, r"backoff_jitter must be in \[0, 1\)"),
        ({"backoff_jitter": -0.1}, "backoff_jitter must be in"),
    ],
)
def test_policy_validation(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EscalationPolicy(**fields)


def test_fault_lived() -> None:
    assert fault(0, lived=42.5).lived_s == 42.5


# --- faultDeadlineSeconds / activeDeadlineSeconds ----------------------------------------------


def test_deadlines_come_from_the_run_policy() -> None:
    policy = EscalationPolicy.from_run_policy(RunPolicy(fault_deadline_s=300.0, active_deadline_s=86400.0))
    assert (policy.fault_deadline_s, policy.active_deadline_s) == (300.0, 86400.0)
    for name in ("fault_deadline_s", "active_deadline_s"):
        with pytest.raises(ConfigError, match=f"escalation.{name} must be more than zero"):
            EscalationPolicy(**{name: 0.0})


def test_a_deadline_fault_fails_the_job() -> None:
    policy = EscalationPolicy()
    for reason, field in (("ActiveDeadline", "activeDeadlineSeconds"), ("FaultDeadline", "faultDeadlineSeconds"),
                          ("StartupDeadline", "startupDeadlineSeconds")):
        decision = policy.decide([fault(0, reason=reason)])
        assert decision.action is Action.FAIL and decision.reason == f"{field} exceeded"
        assert field in decision.detail


def test_fault_period_starts_at_the_fault_after_which_nothing_recovered() -> None:
    policy = EscalationPolicy(stable_after_s=120.0)
    healthy = fault(0, time=T0)  # its generation had beaten: the period starts here
    died1 = fault(1, time=T0 + 5, lived=3.0, first_beat=False)
    died2 = fault(2, time=T0 + 11, lived=3.0, first_beat=False)
    assert policy.fault_period_start([]) is None
    assert policy.fault_period_start([healthy]) == T0
    assert policy.fault_period_start([healthy, died1, died2]) == T0
    recovered = fault(3, time=T0 + 500, lived=400.0, first_beat=False)  # never beat, but ran stably
    assert policy.fault_period_start([healthy, died1, died2, recovered]) == T0 + 500
    beat = fault(3, time=T0 + 20, lived=5.0, first_beat=True)  # beat: recovered, however short
    assert policy.fault_period_start([healthy, died1, beat]) == T0 + 20


def test_fault_deadline_fails_a_restart_that_would_come_too_late() -> None:
    policy = EscalationPolicy(fault_deadline_s=10.0, crash_loop_limit=0, **NO_JITTER)
    history = [fault(0, time=T0), fault(1, time=T0 + 4, lived=2.0, first_beat=False)]
    assert policy.decide(history).action is Action.RESTART  # backoff 1 s: restart at +5 s
    history.append(fault(2, time=T0 + 8.5, lived=2.0, first_beat=False))  # backoff 2 s: +10.5 s
    decision = policy.decide(history)
    assert decision.action is Action.FAIL and decision.reason == "faultDeadlineSeconds exceeded"
    assert "10.5s into the fault period" in decision.detail
    # a recovered generation starts a new period: the same timing restarts
    history[1] = fault(1, time=T0 + 4, lived=2.0, first_beat=True)
    assert policy.decide(history).action is Action.RESTART


def test_deadline_fault_while_running() -> None:
    policy = EscalationPolicy(fault_deadline_s=30.0, active_deadline_s=3600.0)
    history = [fault(0, time=T0)]
    assert policy.deadline_fault(T0 + 29, job_started=T0 - 100, history=history, recovered=False) is None
    reason, detail = policy.deadline_fault(T0 + 30, job_started=T0 - 100, history=history, recovered=False) or ("", "")
    assert reason == "FaultDeadline" and "faultDeadlineSeconds is 30" in detail
    assert policy.deadline_fault(T0 + 30, job_started=T0 - 100, history=history, recovered=True) is None
    assert policy.deadline_fault(T0 + 30, job_started=T0 - 100, history=[], recovered=False) is None
    reason, detail = policy.deadline_fault(T0 + 3500, job_started=T0 - 100, history=[], recovered=True) or ("", "")
    assert reason == "ActiveDeadline" and "activeDeadlineSeconds is 3600" in detail
    assert EscalationPolicy().deadline_fault(T0 + 1e9, job_started=T0, history=history, recovered=False) is None
