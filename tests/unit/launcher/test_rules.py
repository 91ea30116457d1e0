from __future__ import annotations

import re
from typing import Any

import pytest

from tierckpt.launcher.detect.rules import RuleMonitor, RuleState, Verdict
from tierckpt.launcher.jobspec import LogRule, parse_run_policy

T0 = 1_000_000.0  # attempt start, unix seconds


def rule(name: str = "r", pattern: str = ".*Loss:.*", **fields: Any) -> LogRule:
    return LogRule(name=name, log_pattern=re.compile(pattern), **fields)


def batch(i: int, loss: float | str = 1.5, speed: float = 120.0) -> str:
    """A line in the seed's format: "Batch %d Loss: %.5f, Speed: %.2f samples/sec, lr: %.6f"."""
    if isinstance(loss, str):
        return f"Batch {i} Loss: {loss}, Speed: {speed:.2f} samples/sec, lr: 0.000100"
    seed_format = "Batch %d Loss: %.5f, Speed: %.2f samples/sec, lr: %.6f"  # the seed's logger.info format
    return seed_format % (i, loss, speed, 1e-4)  # noqa: UP031


def worst(mon: RuleMonitor, now: float) -> RuleState | None:
    verdict = mon.check(now)
    return None if verdict is None else verdict.state


# The seed's three rules, verbatim, through the job-file parser.
SEED_RULES = parse_run_policy(
    {
        "logMonitoringConfiguration": [
            {"name": "JobStart", "logPattern": ".*Loss:.*", "expectedStartCutOffInSeconds": 240},
            {
                "name": "JobHangingDetection",
                "logPattern": ".*Loss:.*",
                "expectedRecurringFrequencyInSeconds": 300,
            },
            {
                "name": "NoSCheckpointingDetection",
                "logPattern": ".*Completed checkpoint.*",
                "expectedRecurringFrequencyInSeconds": 600,
                "expectedStartCutOffInSeconds": 900,
            },
        ]
    }
)[0].log_rules


# --- the seed's rules --------------------------------------------------------------------------


def test_seed_rules_healthy_run() -> None:
    mon = RuleMonitor(SEED_RULES, T0)
    assert mon.states(T0) == {
        "JobStart": RuleState.WAITING,
        "JobHangingDetection": RuleState.WAITING,
        "NoSCheckpointingDetection": RuleState.WAITING,
    }
    t = T0 + 30
    for i in range(100):  # a batch every 60 s, a checkpoint every 500 s
        mon.feed(batch(i), t)
        if i % 8 == 0:
            mon.feed(f"Completed checkpoint at step {i}", t)
        assert mon.check(t) is None, i
        t += 60
    assert set(mon.states(t - 60).values()) == {RuleState.HEALTHY}


def test_seed_job_start_hangs_after_240s() -> None:
    mon = RuleMonitor(SEED_RULES, T0)
    mon.feed("Loading model...", T0 + 10)
    assert mon.check(T0 + 240) is None  # at the cutoff itself it is still within
    verdict = mon.check(T0 + 240.5)
    assert verdict == Verdict(
        RuleState.HANGING, "JobStart", "LogHang_JobStart", "no line matched '.*Loss:.*' within 240s of start"
    )
    # the recurring rule does not cover the time before the first match
    assert mon.states(T0 + 240.5)["JobHangingDetection"] is RuleState.WAITING


def test_seed_first_loss_in_time_clears_start_rule() -> None:
    mon = RuleMonitor(SEED_RULES, T0)
    mon.feed(batch(0), T0 + 239)
    assert mon.check(T0 + 500) is None
    assert mon.check(T0 + 539) is None  # exactly 300 s since the last Loss line
    verdict = mon.check(T0 + 539.4)
    assert verdict is not None
    assert (verdict.state, verdict.rule, verdict.reason) == (
        RuleState.HANGING,
        "JobHangingDetection",
        "LogHang_JobHangingDetection",
    )
    assert verdict.detail == "no line matched '.*Loss:.*' for 300s (expected every 300s)"
    assert mon.states(T0 + 539.4)["JobStart"] is RuleState.HEALTHY


def test_seed_hang_after_training_stalls() -> None:
    mon = RuleMonitor(SEED_RULES, T0)
    for i in range(5):
        mon.feed(batch(i), T0 + 10 + 10 * i)  # last Loss at T0 + 50
    mon.feed("Completed checkpoint 1", T0 + 55)
    assert mon.check(T0 + 350) is None
    verdict = mon.check(T0 + 351)
    assert verdict is not None and verdict.reason == "LogHang_JobHangingDetection"


def test_seed_checkpoint_start_cutoff_900() -> None:
    mon = RuleMonitor(SEED_RULES, T0)
    t = T0
    while t < T0 + 901:
        mon.feed(batch(int(t)), t)
        t += 50
    assert mon.check(T0 + 900) is None
    verdict = mon.check(T0 + 901)
    assert verdict == Verdict(
        RuleState.HANGING,
        "NoSCheckpointingDetection",
        "LogHang_NoSCheckpointingDetection",
        "no line matched '.*Completed checkpoint.*' within 900s of start",
    )


def test_seed_checkpoint_recurring_600() -> None:
    mon = RuleMonitor(SEED_RULES, T0)
    mon.feed("Completed checkpoint", T0 + 100)
    for k in range(20):
        mon.feed(batch(k), T0 + 100 + 40 * k)  # Loss lines up to T0 + 860
    assert mon.check(T0 + 700) is None
    verdict = mon.check(T0 + 701)
    assert verdict is not None and verdict.rule == "NoSCheckpointingDetection"
    assert verdict.state is RuleState.HANGING


def test_nan_loss_stops_matching_decimal_regex_so_recurring_fires() -> None:
    """The AWS example: "if loss is not decimal (e.g. nan) ... mark it hang as well"."""
    rules = [
        rule("JobHangingDetection", r".*Loss: ([0-9]+\.[0-9]+).*", expected_recurring_frequency_s=300),
    ]
    mon = RuleMonitor(rules, T0)
    mon.feed(batch(1, 2.5), T0 + 10)
    for k in range(2, 40):
        mon.feed(batch(k, "nan"), T0 + 10 * k)  # printed, but not decimal
    assert mon.check(T0 + 310) is None
    verdict = mon.check(T0 + 311)
    assert verdict is not None and verdict.reason == "LogHang_JobHangingDetection"
    assert mon.states(T0 + 311) == {"JobHangingDetection": RuleState.HANGING}


# --- metric rules ------------------------------------------------------------------------------

THROUGHPUT = rule(
    "LowThroughputDetection",
    ".*Speed: ([0-9.]+) samples/sec.*",
    metric_threshold=80,
    operator="lteq",
    metric_evaluation_data_points=25,
)
LOSS_SPIKE = rule(
    "LossSpike", r".*Loss: ([0-9.]+).*", metric_threshold=2.0, operator="gt", metric_evaluation_data_points=5
)


def test_low_throughput_needs_25_consecutive_points() -> None:
    mon = RuleMonitor([THROUGHPUT], T0)
    for i in range(24):
        mon.feed(batch(i, speed=80.0), T0 + i)  # lteq 80: 80.00 violates
        assert mon.check(T0 + i) is None
    assert mon.states(T0 + 24) == {"LowThroughputDetection": RuleState.HEALTHY}
    mon.feed(batch(24, speed=79.5), T0 + 24)
    verdict = mon.check(T0 + 24)
    assert verdict is not None
    assert (verdict.state, verdict.reason) == (RuleState.SLOW, "LogSlow_LowThroughputDetection")
    assert verdict.detail.startswith("25 consecutive values lteq 80 (needs 25); last '79.50' in 'Batch 24")


def test_low_throughput_reset_by_a_good_point() -> None:
    mon = RuleMonitor([THROUGHPUT], T0)
    for i in range(24):
        mon.feed(batch(i, speed=50.0), T0 + i)
    mon.feed(batch(24, speed=80.01), T0 + 24)  # one good point resets the count
    for i in range(25, 49):
        mon.feed(batch(i, speed=50.0), T0 + i)
    assert mon.check(T0 + 49) is None
    mon.feed(batch(49, speed=50.0), T0 + 49)
    assert mon.check(T0 + 49) is not None


def test_slow_recovers_to_healthy() -> None:
    mon = RuleMonitor([LOSS_SPIKE], T0)
    for i in range(5):
        mon.feed(batch(i, loss=2.5), T0 + i)
    assert mon.states(T0 + 5) == {"LossSpike": RuleState.SLOW}
    v = mon.check(T0 + 5)
    assert v is not None and v.reason == "LogSlow_LossSpike"
    mon.feed(batch(5, loss=1.9), T0 + 6)
    assert mon.check(T0 + 6) is None
    assert mon.states(T0 + 6) == {"LossSpike": RuleState.HEALTHY}


def test_loss_spike_threshold_is_strict_for_gt() -> None:
    mon = RuleMonitor([LOSS_SPIKE], T0)
    for i in range(10):
        mon.feed(batch(i, loss=2.0), T0 + i)  # 2.00000 > 2.0 is false
    assert mon.check(T0 + 10) is None


@pytest.mark.parametrize(
    "op, value, violates",
    [
        ("gt", 3.0, True),
        ("gt", 2.0, False),
        ("gteq", 2.0, True),
        ("gteq", 1.9, False),
        ("lt", 1.9, True),
        ("lt", 2.0, False),
        ("lteq", 2.0, True),
        ("lteq", 2.1, False),
        ("eq", 2.0, True),
        ("eq", 2.1, False),
    ],
)
def test_operators(op: str, value: float, violates: bool) -> None:
    mon = RuleMonitor([rule("m", r"v=(\S+)", metric_threshold=2.0, operator=op)], T0)
    mon.feed(f"v={value}", T0)
    assert (mon.check(T0) is not None) is violates


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "1.2.3", "abc"])
def test_non_finite_or_unparsable_metric_is_a_violation(text: str) -> None:
    # lt 0 can never be violated by a finite loss, so only the non-finite rule can fire
    mon = RuleMonitor(
        [
            rule(
                "m", r".*Loss: (\S+),.*", metric_threshold=0.0, operator="lt", metric_evaluation_data_points=2
            )
        ],
        T0,
    )
    mon.feed(batch(1, loss=text), T0)
    assert mon.check(T0) is None
    mon.feed(batch(2, loss=text), T0 + 1)
    verdict = mon.check(T0 + 1)
    assert verdict is not None and verdict.state is RuleState.SLOW
    assert repr(text) in verdict.detail


def test_optional_group_not_taking_part_is_a_violation() -> None:
    mon = RuleMonitor([rule("m", r"step(?: loss=(\d+))?", metric_threshold=100.0, operator="gt")], T0)
    mon.feed("step loss=5", T0)
    assert mon.check(T0) is None
    mon.feed("step", T0 + 1)
    verdict = mon.check(T0 + 1)
    assert verdict is not None and "last None" in verdict.detail


def test_capture_group_without_threshold_just_means_healthy() -> None:
    mon = RuleMonitor([rule("m", r".*Loss: (\S+),.*")], T0)
    mon.feed(batch(1, loss="nan"), T0)
    assert mon.check(T0) is None
    assert mon.states(T0) == {"m": RuleState.HEALTHY}


def test_violating_matches_still_reset_the_recurring_timer() -> None:
    r = rule(
        "m",
        r".*Loss: ([0-9.]+).*",
        metric_threshold=2.0,
        operator="gt",
        metric_evaluation_data_points=100,
        expected_recurring_frequency_s=10,
    )
    mon = RuleMonitor([r], T0)
    for i in range(20):
        mon.feed(batch(i, loss=5.0), T0 + 5 * i)
        assert mon.check(T0 + 5 * i + 9) is None


# --- matching semantics ------------------------------------------------------------------------


def test_log_pattern_matches_from_line_start_only() -> None:
    mon = RuleMonitor([rule("m", "Loss:", expected_start_cutoff_s=10)], T0)
    mon.feed(batch(1), T0 + 1)  # 'Loss:' appears mid-line: re.match does not find it
    assert mon.states(T0 + 1) == {"m": RuleState.WAITING}
    mon.feed("Loss: 1.0", T0 + 2)
    assert mon.states(T0 + 2) == {"m": RuleState.HEALTHY}


def test_stop_pattern_deactivates_permanently() -> None:
    r = rule(
        "m",
        ".*Loss:.*",
        expected_recurring_frequency_s=10,
        stop_pattern=re.compile(".*Training done.*"),
        fault_on_match=False,
    )
    mon = RuleMonitor([r], T0)
    mon.feed(batch(1), T0)
    mon.feed("Training done, entering eval", T0 + 5)
    assert mon.check(T0 + 1000) is None
    mon.feed(batch(2), T0 + 1001)
    assert mon.states(T0 + 5000) == {"m": RuleState.HEALTHY}


def test_stop_pattern_is_checked_before_log_pattern() -> None:
    r = rule("OOM", ".*out of memory.*", fault_on_match=True, stop_pattern=re.compile(".*done.*"))
    mon = RuleMonitor([r], T0)
    mon.feed("done: out of memory counters reset", T0)  # matches both: the stop wins
    mon.feed("RuntimeError: CUDA out of memory", T0 + 1)
    assert mon.check(T0 + 1) is None


def test_stop_pattern_before_first_match_disarms_start_cutoff() -> None:
    r = rule("m", ".*Loss:.*", expected_start_cutoff_s=10, stop_pattern=re.compile("skip training"))
    mon = RuleMonitor([r], T0)
    mon.feed("skip training", T0 + 1)
    assert mon.check(T0 + 100) is None


def test_fault_on_match_is_immediate_and_sticky() -> None:
    oom = rule("OOM", ".*RuntimeError.*out of memory.*", fault_on_match=True)
    mon = RuleMonitor([oom, *SEED_RULES], T0)
    mon.feed(batch(1), T0 + 1)
    assert mon.check(T0 + 1) is None
    line = "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    mon.feed(line, T0 + 2)
    expected = Verdict(
        RuleState.FAULTED, "OOM", "LogFault_OOM", f"line matched '.*RuntimeError.*out of memory.*': {line!r}"
    )
    assert mon.check(T0 + 2) == expected
    mon.feed(batch(2), T0 + 3)
    assert mon.check(T0 + 3) == expected
    assert mon.states(T0 + 3)["OOM"] is RuleState.FAULTED


def test_long_lines_are_shortened_in_details() -> None:
    mon = RuleMonitor([rule("F", "boom", fault_on_match=True)], T0)
    mon.feed("boom" + "x" * 1000, T0)
    verdict = mon.check(T0)
    assert verdict is not None and verdict.detail.endswith("...'") and len(verdict.detail) < 300


# --- aggregation -------------------------------------------------------------------------------


def test_worst_state_wins_across_rules() -> None:
    oom = rule("OOM", ".*out of memory.*", fault_on_match=True)
    start = rule("Start", ".*Loss:.*", expected_start_cutoff_s=10)
    spike = rule("Spike", r".*Speed: ([0-9.]+).*", metric_threshold=100.0, operator="lt")
    mon = RuleMonitor([spike, start, oom], T0)
    mon.feed("Speed: 5.0", T0 + 1)
    assert worst(mon, T0 + 1) is RuleState.SLOW
    verdict = mon.check(T0 + 11)
    assert verdict is not None and verdict.rule == "Start" and verdict.state is RuleState.HANGING
    mon.feed("out of memory", T0 + 12)
    verdict = mon.check(T0 + 12)
    assert verdict is not None and verdict.rule == "OOM" and verdict.state is RuleState.FAULTED
    assert mon.states(T0 + 12) == {
        "Spike": RuleState.SLOW,
        "Start": RuleState.HANGING,
        "OOM": RuleState.FAULTED,
    }


def test_ties_go_to_the_first_rule() -> None:
    a = rule("A", "a", expected_start_cutoff_s=5)
    b = rule("B", "b", expected_start_cutoff_s=5)
    first = RuleMonitor([b, a], T0).check(T0 + 6)
    assert first is not None and first.rule == "B"
    first = RuleMonitor([a, b], T0).check(T0 + 6)
    assert first is not None and first.rule == "A"


def test_hanging_beats_slow_within_one_rule() -> None:
    r = rule("m", r"v=(\d+)", metric_threshold=1.0, operator="gt", expected_recurring_frequency_s=10)
    mon = RuleMonitor([r], T0)
    mon.feed("v=5", T0)
    assert worst(mon, T0 + 10) is RuleState.SLOW
    assert worst(mon, T0 + 11) is RuleState.HANGING


def test_no_rules() -> None:
    mon = RuleMonitor([], T0)
    mon.feed("anything", T0)
    assert mon.check(T0 + 1e6) is None
    assert mon.states(T0) == {}


def test_state_priority_order() -> None:
    assert RuleState.FAULTED > RuleState.HANGING > RuleState.SLOW > RuleState.HEALTHY > RuleState.WAITING


def test_a_match_after_the_start_cutoff_clears_hanging() -> None:
    mon = RuleMonitor([rule("m", "x", expected_start_cutoff_s=10)], T0)
    assert mon.check(T0 + 11) is not None
    mon.feed("x", T0 + 12)
    assert mon.check(T0 + 12) is None


# --- pause / resume ----------------------------------------------------------------------------


def test_pause_suspends_start_cutoff() -> None:
    mon = RuleMonitor(SEED_RULES, T0)
    mon.pause(T0 + 200)
    assert mon.paused
    assert mon.check(T0 + 10_000) is None  # 200 s of running time so far
    mon.resume(T0 + 10_000)
    assert not mon.paused
    assert mon.check(T0 + 10_040) is None  # 240 s running
    verdict = mon.check(T0 + 10_041)
    assert verdict is not None and verdict.rule == "JobStart"


def test_pause_suspends_recurring_timer() -> None:
    mon = RuleMonitor([rule("h", ".*Loss:.*", expected_recurring_frequency_s=300)], T0)
    mon.feed(batch(1), T0 + 10)
    mon.pause(T0 + 110)
    mon.resume(T0 + 5000)
    assert mon.check(T0 + 5200) is None  # 100 + 200 s since the match
    assert mon.check(T0 + 5201) is not None


def test_pause_and_resume_are_idempotent() -> None:
    mon = RuleMonitor([rule("s", "x", expected_start_cutoff_s=100)], T0)
    mon.pause(T0 + 50)
    mon.pause(T0 + 80)  # still paused since T0 + 50
    mon.resume(T0 + 150)
    mon.resume(T0 + 170)  # not paused: no effect
    assert mon.check(T0 + 200) is None  # 50 + 50 s of running time
    assert mon.check(T0 + 201) is not None


def test_lines_while_paused_count_at_the_pause_time() -> None:
    mon = RuleMonitor([rule("h", "x", expected_recurring_frequency_s=30)], T0)
    mon.pause(T0 + 10)
    mon.feed("x", T0 + 500)  # buffered output read late
    mon.resume(T0 + 1000)
    assert mon.check(T0 + 1030) is None
    assert mon.check(T0 + 1031) is not None


def test_several_pauses_add_up() -> None:
    mon = RuleMonitor([rule("s", "x", expected_start_cutoff_s=100)], T0)
    for k in range(3):
        mon.pause(T0 + 20 + 1000 * k)
        mon.resume(T0 + 1000 * (k + 1))
    # running: 20 + 20 + 20 + (now - (T0 + 3000))
    assert mon.check(T0 + 3040) is None
    assert mon.check(T0 + 3041) is not None
