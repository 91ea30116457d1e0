"""Backoff resets after healthy progress, as Kubernetes resets CrashLoopBackOff (issue 24, item 2):
faults far apart, each after healthy training, restart at once; crash loops still back off."""

from __future__ import annotations

from typing import Any

from tierckpt.launcher.decide.escalation import Action, EscalationPolicy, Fault

T0 = 1_700_000_000.0
NO_JITTER: dict[str, Any] = {"backoff_jitter": 0.0}


def fault(g: int, *, lived: float, step: int | None = None, resumed_step: int | None = None,
          first_beat: bool = True) -> Fault:
    t = T0 + 100 * g
    return Fault(generation=g, time=t, generation_started=t - lived, reason="Crash", first_beat=first_beat,
                 step=step, resumed_step=resumed_step)


def delays(policy: EscalationPolicy, history: list[Fault], **kw: Any) -> list[float]:
    out = []
    for n in range(1, len(history) + 1):
        d = policy.decide(history[:n], **kw)
        assert d.action == Action.RESTART, d
        out.append(d.delay_s)
    return out


def test_faults_after_healthy_progress_restart_at_once() -> None:
    """The issue's job: 8 faults over 150 steps, each after 10+ steps past the resumed step, each
    generation far younger than ``stable_after_s``: no fault waits."""
    policy = EscalationPolicy(**NO_JITTER)
    history, resumed = [], 0
    for g in range(8):
        step = resumed + 12 + g  # 12..19 steps of progress, 15 s or so of training
        history.append(fault(g, lived=15.0, step=step, resumed_step=resumed))
        resumed = step - 1  # saved every step: the next generation resumes just below it
    assert delays(policy, history) == [0.0] * 8
    assert policy.unhealthy_streak(history) == 0


def test_the_default_is_ten_steps_and_it_counts_from_the_resumed_step() -> None:
    policy = EscalationPolicy(**NO_JITTER)
    assert policy.healthy_after_steps == 10
    assert policy.healthy(fault(1, lived=5.0, step=110, resumed_step=100))
    assert not policy.healthy(fault(1, lived=5.0, step=109, resumed_step=100))
    assert not policy.healthy(fault(1, lived=5.0, step=500, resumed_step=None))  # no baseline: not by steps
    assert policy.healthy(fault(1, lived=120.0, step=None))  # or by time, as before
    assert not EscalationPolicy(healthy_after_steps=0).healthy(fault(1, lived=5.0, step=900, resumed_step=0))


def test_a_crash_loop_before_the_first_beat_still_backs_off() -> None:
    policy = EscalationPolicy(crash_loop_limit=0, **NO_JITTER)
    history = [fault(g, lived=2.0, step=None, first_beat=False) for g in range(6)]
    assert delays(policy, history) == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0]


def test_a_loop_without_progress_still_backs_off() -> None:
    """Beats, but dies within a few steps of the resumed step each time."""
    policy = EscalationPolicy(no_progress_limit=0, **NO_JITTER)
    history = [fault(g, lived=3.0, step=100 + 3 * g + 2, resumed_step=100 + 3 * g) for g in range(5)]
    assert delays(policy, history) == [0.0, 1.0, 2.0, 4.0, 8.0]


def test_healthy_progress_in_the_middle_of_a_loop_resets_it() -> None:
    policy = EscalationPolicy(crash_loop_limit=0, **NO_JITTER)
    quick = [fault(g, lived=2.0, first_beat=False) for g in range(3)]
    healthy = [fault(3, lived=5.0, step=40, resumed_step=20)]
    again = [fault(g, lived=2.0, first_beat=False) for g in (4, 5)]
    assert delays(policy, quick + healthy + again) == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]


def test_the_streak_carries_over_a_full_job_restart() -> None:
    """``unhealthy_before`` (the restart-state file's ``unhealthy_streak``) continues the backoff of
    a crash loop in the next incarnation; a healthy end of the last one starts afresh."""
    policy = EscalationPolicy(crash_loop_limit=0, **NO_JITTER)
    before = [fault(g, lived=2.0, first_beat=False) for g in range(3)]
    streak = policy.unhealthy_streak(before)
    assert streak == 3 and policy.decide(before).delay_s == 2.0
    after = [fault(g, lived=2.0, first_beat=False) for g in (4, 5)]
    assert delays(policy, after, prior_restarts=4, unhealthy_before=streak) == [8.0, 16.0]
    assert policy.unhealthy_streak(after, streak) == 5
    # the incarnation's history ends a healthy run: the carried streak no longer counts
    mixed = [fault(4, lived=2.0, step=30, resumed_step=10), fault(5, lived=2.0, first_beat=False)]
    assert delays(policy, mixed, prior_restarts=4, unhealthy_before=streak) == [0.0, 1.0]
    assert policy.unhealthy_streak(mixed, streak) == 1


def test_healthy_after_steps_is_validated() -> None:
    import pytest

    from tierckpt.errors import ConfigError

    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="healthy_after_steps"):
            EscalationPolicy(healthy_after_steps=bad)  # type: ignore[arg-type]
    assert EscalationPolicy(healthy_after_steps=None).healthy_after_steps is None
