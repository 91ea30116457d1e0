"""``restartPolicy.scaleUpSnoozeTimeInSeconds`` (``launcher/membership/snooze.py``): pure, from a parsed job file."""

from __future__ import annotations

import pytest

from tierckpt.errors import ConfigError
from tierckpt.launcher.jobspec import parse_run_policy
from tierckpt.launcher.membership.change import Change
from tierckpt.launcher.membership.snooze import ScaleUpSnooze, scaled_down


def test_a_scale_up_waits_the_snooze_after_a_scale_down() -> None:
    rp, ignored = parse_run_policy({"restartPolicy": {"evalPeriodSeconds": 60, "scaleUpSnoozeTimeInSeconds": 30}},
                                   where="runPolicy")
    assert ignored == []  # the launcher acts on it now
    snooze = ScaleUpSnooze.from_restart_policy(rp.restart_policy)
    assert snooze == ScaleUpSnooze(snooze_s=30.0)
    assert snooze.allows(100.0, None)  # never scaled down
    assert not snooze.allows(100.0, 80.0)  # 20 s after the scale-down
    assert snooze.allows(110.0, 80.0)  # 30 s after
    assert ScaleUpSnooze.from_restart_policy(None).allows(0.0, 0.0)  # no restartPolicy: no snooze


def test_only_a_round_with_fewer_nodes_is_a_scale_down() -> None:
    two, one = {0: "a", 1: "b"}, {0: "a"}
    assert scaled_down(Change(before=two, after=one))
    assert not scaled_down(Change(before=one, after=two))  # a scale-up
    assert not scaled_down(Change(before=two, after={0: "a", 1: "spare"}))  # a spare replaced b
    assert not scaled_down(Change(before={}, after=one))  # the first round


def test_a_negative_snooze_is_refused() -> None:
    with pytest.raises(ConfigError, match="scaleUpSnoozeTimeInSeconds"):
        ScaleUpSnooze(snooze_s=-1.0)
