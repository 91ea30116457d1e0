"""The node health checks (launcher/detect/health.py) and the monitor that judges them
(detect/healthwatch.py), on real parts where they can exist here: this machine's ``/sys/class/net``,
a real tmpfs made full and read-only, real commands that fail and hang. Fakes only for what this
machine cannot have: a fake sysfs tree for a NIC whose carrier flaps and whose error counters grow
and for EDAC memory controllers (the kernel here has none), a fake ``nvidia-smi`` script for a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tierckpt.errors import ConfigError
from tierckpt.launcher.detect.health import (
    OK,
    UNHEALTHY,
    WARN,
    CommandCheck,
    EdacCheck,
    GpuCheck,
    HealthConfig,
    MemfsCheck,
    NicCheck,
    build_checks,
    route_interface,
    validate_command,
)
from tierckpt.launcher.detect.healthwatch import HealthWatch, judge
from tierckpt.launcher.events import Events


def _fake_nic(root: Path, name: str, *, oper: str = "up", carrier: int = 1, changes: int = 2,
              rx: int = 0, tx: int = 0) -> None:
    """A fake ``/sys/class/net/<name>`` (a real interface cannot flap or count errors on demand here)."""
    d = root / "class" / "net" / name
    (d / "statistics").mkdir(parents=True, exist_ok=True)
    for f, v in (("operstate", oper), ("carrier", carrier), ("carrier_changes", changes),
                 ("statistics/rx_errors", rx), ("statistics/tx_errors", tx)):
        (d / f).write_text(f"{v}\n")


def test_loopback_is_a_healthy_nic_and_a_missing_one_is_not() -> None:
    """The real ``/sys/class/net/lo`` (operstate ``unknown``, carrier 1) passes, twice (counters
    judged by increase); a name that is no interface fails."""
    check = NicCheck(["lo", "nosuch0"], sysfs="/sys", error_limit=10)
    for _ in range(2):
        lo, missing = check.run()
        assert (lo.status, missing.status) == (OK, UNHEALTHY), (lo, missing)
    assert "no such interface" in missing.detail


def test_a_real_interface_that_is_down_fails() -> None:
    """Any interface of this machine that is administratively down (its carrier file reads EINVAL)."""
    down = [n.name for n in Path("/sys/class/net").iterdir() if (n / "operstate").read_text().strip() == "down"]
    if not down:
        pytest.skip("no interface is down on this machine")
    (r,) = NicCheck([down[0]], sysfs="/sys", error_limit=10).run()
    assert r.status == UNHEALTHY and "carrier down" in r.detail, r


def test_nic_counters_are_judged_by_their_increase(tmp_path: Path) -> None:
    _fake_nic(tmp_path, "eth9", changes=7, rx=5000, tx=300)  # old errors: not a finding
    check = NicCheck(["eth9"], sysfs=str(tmp_path), error_limit=10)
    assert check.run()[0].status == OK
    assert check.run()[0].status == OK
    _fake_nic(tmp_path, "eth9", changes=7, rx=5003, tx=300)
    assert check.run()[0].status == WARN  # 3 new errors, below the limit
    _fake_nic(tmp_path, "eth9", changes=7, rx=5010, tx=305)
    r = check.run()[0]
    assert r.status == UNHEALTHY and "12 rx/tx errors" in r.detail, r
    _fake_nic(tmp_path, "eth9", changes=9, rx=5010, tx=305)
    r = check.run()[0]
    assert r.status == UNHEALTHY and "flapped (2 carrier changes" in r.detail, r
    _fake_nic(tmp_path, "eth9", changes=0, rx=0, tx=0)  # a driver reload resets the counters: no finding
    assert check.run()[0].status == OK
    _fake_nic(tmp_path, "eth9", oper="down", carrier=0)
    assert check.run()[0].status == UNHEALTHY


def test_edac_uncorrectable_errors_fail_and_correctable_ones_warn(tmp_path: Path) -> None:
    """A fake EDAC tree (this kernel has no memory controllers in sysfs); absent, auto mode skips it."""
    assert not EdacCheck.present(str(tmp_path))
    assert [c.name for c in build_checks(HealthConfig(checks=None, sysfs=str(tmp_path)))] == []
    mc = tmp_path / "devices" / "system" / "edac" / "mc" / "mc0"
    mc.mkdir(parents=True)
    (mc / "ue_count").write_text("1\n")
    (mc / "ce_count").write_text("40\n")
    assert [c.name for c in build_checks(HealthConfig(checks=None, sysfs=str(tmp_path)))] == ["edac"]
    check = EdacCheck(sysfs=str(tmp_path))
    assert check.run()[0].status == OK  # errors before the first round are history
    (mc / "ce_count").write_text("41\n")
    assert check.run()[0].status == WARN
    (mc / "ue_count").write_text("2\n")
    r = check.run()[0]
    assert r.status == UNHEALTHY and "1 new uncorrectable" in r.detail, r


@pytest.fixture
def tmpfs(tmp_path: Path) -> Any:
    """A real 1 MiB tmpfs (needs root to mount; skipped otherwise), unmounted afterwards."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_memfs_fails_on_a_full_and_on_a_read_only_tmpfs(tmpfs: Path) -> None:
    tier = tmpfs / "tierckpt"
    tier.mkdir()
    check = MemfsCheck(str(tier), min_free=64 << 10)
    r = check.run()[0]
    assert r.status == OK and "writable" in r.detail, r
    assert not [p for p in tier.iterdir()], "the probe file was removed"
    with open(tmpfs / "fill", "wb") as f:  # fill it up
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    r = check.run()[0]
    assert r.status == UNHEALTHY and "bytes free" in r.detail, r
    (tmpfs / "fill").unlink()
    assert check.run()[0].status == OK
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    r = check.run()[0]
    assert r.status == UNHEALTHY and "read-only" in r.detail, r


def test_memfs_of_a_tier_not_created_yet_looks_at_its_parent(tmp_path: Path) -> None:
    r = MemfsCheck(str(tmp_path / "not" / "yet"), min_free=0).run()[0]
    assert r.status == OK and str(tmp_path) in r.detail, r


def test_commands_pass_fail_and_time_out() -> None:
    assert CommandCheck("true", timeout_s=5).run()[0].status == OK
    r = CommandCheck("echo first; echo 'disk sdb failing' >&2; exit 3", timeout_s=5).run()[0]
    assert (r.status, r.detail) == (UNHEALTHY, "exit 3: disk sdb failing"), r
    t0 = time.monotonic()
    r = CommandCheck("sleep 30 & sleep 30", timeout_s=0.3).run()[0]  # its children are killed too
    assert r.status == UNHEALTHY and "no answer within 0.3s" in r.detail, r
    assert time.monotonic() - t0 < 3.0


def test_bad_health_options_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--health-interval must be more than 0"):
        HealthConfig(interval_s=0)
    with pytest.raises(ConfigError, match="--health-interval"):
        HealthConfig(interval_s=float("nan"))
    with pytest.raises(ConfigError, match="--health-fail-after"):
        HealthConfig(fail_after=0)
    with pytest.raises(ConfigError, match="unknown check.*'disk'.*nic, edac, memfs, gpu"):
        HealthConfig(checks=("nic", "disk"))
    with pytest.raises(ConfigError, match="--health-nic"):
        HealthConfig(nics=("../eth0",))
    with pytest.raises(ConfigError, match="'no-such-checker' is not an executable file on PATH"):
        validate_command("no-such-checker --quick")
    with pytest.raises(ConfigError, match="is not an executable file"):
        build_checks(HealthConfig(commands=(str(tmp_path / "check.sh"),)))
    with pytest.raises(ConfigError, match="does not parse"):
        validate_command("echo 'unbalanced")
    with pytest.raises(ConfigError, match="nvidia-smi.*not on PATH"):
        build_checks(HealthConfig(checks=("gpu",), nvidia_smi=str(tmp_path / "nvidia-smi")))
    with pytest.raises(ConfigError, match="--health-nic"):
        build_checks(HealthConfig(checks=("nic",)))
    for ok in ("test ! -e /tmp/x", "! false", "FOO=1 true", "/bin/true"):
        validate_command(ok)


def _fake_smi(path: Path, rows: list[str], code: int = 0) -> None:
    """A fake ``nvidia-smi`` (no GPU here): prints ``rows`` as the CSV query answer, exits ``code``."""
    body = "".join(f"echo '{r}'\n" for r in rows)
    path.write_text(f"#!/bin/sh\n{body}exit {code}\n")
    path.chmod(0o755)


def test_gpu_check_on_a_fake_nvidia_smi(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    a, b = "GPU-aaaa", "GPU-bbbb"
    _fake_smi(smi, [f"0, {a}, 0, No", f"1, {b}, [N/A], [N/A]"])
    check = GpuCheck(str(smi), timeout_s=5)
    assert [r.status for r in check.run()] == [OK, OK]
    _fake_smi(smi, [f"0, {a}, 2, No", f"1, {b}, [N/A], [N/A]"])
    r = check.run()
    assert r[0].status == UNHEALTHY and "2 new uncorrectable ECC" in r[0].detail, r
    _fake_smi(smi, [f"0, {a}, 2, Yes"])
    r = check.run()
    assert {(x.subject, x.status) for x in r} == {(b, UNHEALTHY), ("gpu0", UNHEALTHY)}, r
    assert any("gone" in x.detail for x in r) and any("retirement is pending" in x.detail for x in r)
    _fake_smi(smi, ["Unable to determine the device handle for GPU0000:07:00.0: Unknown Error"], code=15)
    r = check.run()
    assert len(r) == 1 and r[0].status == UNHEALTHY and "exit 15: Unable to determine" in r[0].detail, r
    assert [c.name for c in build_checks(HealthConfig(checks=("gpu",), nvidia_smi=str(smi)))] == ["gpu"]


#: ``nvidia-smi --query-gpu=<GpuCheck.QUERY> --format=csv,noheader,nounits`` as an H100 answered it
#: (driver 580.159.04, the lent GPU machine): no page retirement there ([N/A]), row remapping instead
H100 = "0, GPU-498cc3e4-d0a6-69bb-bae2-cebc46c3cf40, 0, [N/A], No, No"


def test_gpu_check_on_an_answer_captured_from_an_h100_and_on_an_old_driver(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    _fake_smi(smi, [H100])
    check = GpuCheck(str(smi), timeout_s=5)
    assert [(r.subject, r.status) for r in check.run() + check.run()] == [("gpu0", OK), ("gpu0", OK)]
    _fake_smi(smi, [H100.replace("No, No", "Yes, No")])
    assert "row remapping is pending" in check.run()[0].detail
    _fake_smi(smi, [H100.replace("No, No", "No, Yes")])
    assert "row remapping failed" in check.run()[0].detail
    # a driver without row remapping refuses the fields: the check goes on without them
    smi.write_text('#!/bin/sh\ncase "$1" in *remapped_rows*) echo \'Field "remapped_rows.pending" is not a valid '
                   'field to query.\'; exit 2;; esac\necho "0, GPU-old, 0, No"\n')
    old = GpuCheck(str(smi), timeout_s=5)
    assert [(r.subject, r.status) for r in old.run()] == [("gpu0", OK)] and old.query == GpuCheck.BASE


def test_route_interface_of_loopback() -> None:
    assert route_interface("127.0.0.1") == "lo"
    assert route_interface("no-such-host.invalid") is None


def test_judge_needs_fail_after_rounds_in_a_row() -> None:
    from tierckpt.launcher.detect.health import CheckResult

    bad, good = CheckResult("nic", "eth0", UNHEALTHY, "x"), CheckResult("nic", "eth0", OK, "y")
    streaks, failing = judge({}, [bad], 2)
    assert failing == ()
    streaks, failing = judge(streaks, [bad], 2)
    assert failing == (bad,)
    streaks, failing = judge(streaks, [good], 2)
    assert failing == () and streaks == {("nic", "eth0"): 0}


def test_the_monitor_reports_each_change_once_and_recovers(tmp_path: Path) -> None:
    """A real command that starts failing when a file appears: two failing rounds make the node
    unhealthy (events ``failing`` then ``unhealthy``, the gauge at 0), the file's removal heals it."""
    flag = tmp_path / "bad"
    path = tmp_path / "events.jsonl"
    events = Events(str(path), node=0)
    watch = HealthWatch(build_checks(HealthConfig(checks=(), commands=(f"test ! -e {flag}",))), events,
                        interval_s=0.05, fail_after=2)
    assert watch.run_once().healthy and watch.run_once().healthy
    flag.touch()
    assert watch.run_once().healthy  # one failing round is not yet a bad node
    v = watch.run_once()
    assert not v.healthy and v.checks == ["command"] and f"command 'test ! -e {flag}': exit 1" == v.detail, v
    assert not watch.run_once().healthy
    assert "tierckpt_run_node_healthy 0" in events.registry.render()
    flag.unlink()
    assert watch.run_once().healthy
    watch.start()  # the thread: the first event lists the checks
    deadline = time.monotonic() + 5
    while watch.verdict().rounds < 8 and time.monotonic() < deadline:
        time.sleep(0.02)
    watch.close()
    events.close()
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    statuses = [r["status"] for r in recs if r["event"] == "health"]
    assert statuses == ["failing", "unhealthy", "ok", "watching"], recs
    assert watch.verdict().rounds >= 8
    text = events.registry.render()
    assert 'tierckpt_run_health_failures_total{check="command"} 1' in text and "tierckpt_run_node_healthy 1" in text
    assert set(os.listdir(tmp_path)) == {"events.jsonl"}  # the flag removed, no probe left behind
