"""Heartbeats (worker writer, launcher reader, self-tuning timeout on a fake clock) and the store
control plane (a real TCPStore on 127.0.0.1: claims, generation, barrier, liveness)."""

from __future__ import annotations

import datetime
import math
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import tierckpt.monitor as monitor
from tierckpt.launcher.control import keys
from tierckpt.launcher.control.jobcontrol import JobControl, Liveness
from tierckpt.launcher.control.store import connect_client
from tierckpt.launcher.detect.heartbeat import BeatTracker, HeartbeatPolicy
from tierckpt.monitor import Beat, read_beat


def test_monitor_writes_records_the_launcher_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPT_MONITOR_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(monitor, "_writer_pid", None)
    assert read_beat(str(tmp_path / "beat_3")) is None
    monitor.step(7, loss=0.5)
    b = read_beat(str(tmp_path / "beat_3"))
    assert b is not None and (b.seq, b.step, b.loss, b.non_finite) == (1, 7, 0.5, False)
    monitor.beat()
    b = read_beat(str(tmp_path / "beat_3"))
    assert b is not None and (b.seq, b.step) == (2, 7)
    monitor.step(8, loss=math.inf)
    b = read_beat(str(tmp_path / "beat_3"))
    assert b is not None and b.non_finite and b.step == 8
    raw = bytearray((tmp_path / "beat_3").read_bytes())
    raw[9] ^= 0xFF  # a torn or damaged record is ignored, not misread
    (tmp_path / "beat_3").write_bytes(bytes(raw))
    assert read_beat(str(tmp_path / "beat_3")) is None


def test_monitor_without_launcher_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERCKPT_MONITOR_DIR", raising=False)
    monkeypatch.setattr(monitor, "_writer_pid", None)
    monitor.step(1, loss=1.0)
    monitor.beat()
    assert monitor._get_writer() is None


def _beat(seq: int, step: int | None = None, non_finite: bool = False) -> Beat:
    return Beat(seq=seq, step=step, time=0.0, loss=math.nan if non_finite else 1.0, non_finite=non_finite)


def test_timeout_tunes_itself_from_the_longest_interval() -> None:
    tr = BeatTracker(HeartbeatPolicy(safety_factor=3.0, floor_s=5.0, warmup_intervals=3, initial_timeout_s=100.0),
                     start=0.0)
    assert tr.timeout() is None and tr.check(10_000.0) is None  # never beat: no startup deadline
    tr.observe(_beat(1, 1), 50.0)
    assert tr.timeout() == 100.0 and not tr.calibrated
    for i, t in enumerate((52.0, 54.5, 56.0), start=2):
        tr.observe(_beat(i, i), t)
    assert tr.calibrated and tr.longest == 2.5 and tr.timeout() == 7.5
    assert tr.check(56.0 + 7.4) is None
    reason, detail = tr.check(56.0 + 7.6) or ("", "")
    assert reason == "Hang" and "after step 4" in detail
    assert not tr.observe(_beat(4, 4), 58.0)  # the same record again is no beat
    assert tr.observe(_beat(5, 5), 60.0)
    assert tr.longest == 4.0 and tr.timeout() == 12.0 and tr.check(66.0) is None


def test_floor_and_fixed_timeout_and_startup_deadline() -> None:
    tr = BeatTracker(HeartbeatPolicy(floor_s=5.0, warmup_intervals=1), start=0.0)
    tr.observe(_beat(1), 1.0)
    tr.observe(_beat(2), 1.1)
    assert tr.timeout() == 5.0
    fixed = BeatTracker(HeartbeatPolicy(fixed_timeout_s=2.0), start=0.0)
    fixed.observe(_beat(1), 1.0)
    assert fixed.timeout() == 2.0 and fixed.check(3.5) is not None
    start = BeatTracker(HeartbeatPolicy(startup_deadline_s=30.0), start=100.0)
    assert start.check(129.0) is None
    assert (start.check(131.0) or ("",))[0] == "StartupDeadline"
    # a log-rule match is a start as good as a first beat (startupDeadlineSeconds is the job's start)
    assert start.check(131.0, started=True) is None
    with pytest.raises(ValueError):
        HeartbeatPolicy(fixed_timeout_s=0)


def test_non_finite_loss_is_a_fault_at_once() -> None:
    tr = BeatTracker(HeartbeatPolicy(), start=0.0)
    tr.observe(_beat(1, 3, non_finite=True), 1.0)
    assert (tr.check(1.0) or ("",))[0] == "NonFiniteLoss"


@pytest.fixture
def store() -> dist.TCPStore:  # type: ignore[name-defined]
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))  # type: ignore[attr-defined]


def test_first_claim_wins_and_the_generation_moves_once(store: dist.TCPStore) -> None:  # type: ignore[name-defined]
    a, b = JobControl(store), JobControl(connect_client("127.0.0.1", store.port))
    assert a.claimed(0) is None
    won = a.claim(0, {"reason": "Crash", "node": 0})
    lost = b.claim(0, {"reason": "LostNode", "node": 1})
    assert won == lost == {"reason": "Crash", "node": 0}
    assert a.get_int(keys.GENERATION) == b.get_int(keys.GENERATION) == 1
    b.claim(1, {"reason": "Hang"})
    assert [r["reason"] for r in a.history(1)] == ["Crash", "Hang"]
    assert a.wait_stopped(0, 2, timeout=0.05) is False
    a.stopped(0)
    b.stopped(0)
    assert a.wait_stopped(0, 2, timeout=1.0)
    b.publish_master(1, "127.0.0.1", 4321)
    assert a.master(1, timeout=1.0) == ("127.0.0.1", 4321)


@pytest.mark.parametrize("libuv", [False, True], ids=["legacy-server", "libuv-server"])
def test_wait_claim_wakes_at_the_claim_on_either_store_server(libuv: bool) -> None:
    """Reproduces: torch's legacy server does not wake a waiter on ``compare_set``, so a wait on the
    claim key slept out its whole timeout there (it returned the claim only then)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=libuv,  # type: ignore[attr-defined]
                           timeout=datetime.timedelta(seconds=10))
    waiter, claimer = JobControl(connect_client("127.0.0.1", server.port)), JobControl(server)
    got: dict[str, object] = {}

    def wait() -> None:
        t0 = time.monotonic()
        got["claim"] = waiter.wait_claim(3, timeout=8.0)
        got["waited"] = time.monotonic() - t0

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)  # the waiter is blocked in the store's wait
    claimer.claim(3, {"reason": "Crash", "node": 1})
    t.join(20)
    assert got["claim"] == {"reason": "Crash", "node": 1}
    assert isinstance(got["waited"], float) and got["waited"] < 5.0, got  # woken, not timed out (8 s)
    assert waiter.wait_claim(4, timeout=0.05) is None


def test_join_takes_the_highest_generation_any_node_remembers(store: dist.TCPStore) -> None:  # type: ignore[name-defined]
    out: dict[int, tuple[int, int]] = {}
    round_store = dist.PrefixStore("round1", store)  # type: ignore[attr-defined]

    def node(i: int, nxt: int, full: int) -> None:
        ctl = JobControl(connect_client("127.0.0.1", store.port))
        out[i] = ctl.join(dist.PrefixStore("round1", connect_client("127.0.0.1", store.port)), 2,  # type: ignore[attr-defined]
                          local_next=nxt, local_full=full, timeout=10)

    threads = [threading.Thread(target=node, args=a) for a in ((0, 3, 1), (1, 0, 0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {0: (3, 1), 1: (3, 1)}
    assert int(round_store.add("tierckpt/joined", 0)) == 2


def test_liveness_reports_a_silent_agent(store: dist.TCPStore) -> None:  # type: ignore[name-defined]
    port = store.port
    a = Liveness(lambda: connect_client("127.0.0.1", port), 0, interval_s=0.05, timeout_s=0.5)
    b = Liveness(lambda: connect_client("127.0.0.1", port), 1, interval_s=0.05, timeout_s=0.5)
    a.reset(0, [0, 1])
    b.reset(1, [0, 1])
    a.start()
    b.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and a.lost():
        time.sleep(0.02)
    time.sleep(0.6)
    assert a.lost() == [] and b.lost() == []
    b.close()  # node 1 goes silent
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not a.lost():
        time.sleep(0.02)
    assert a.lost() == [1]
    a.close()


def test_waker_ends_the_wait_when_a_child_exits_or_on_notify() -> None:
    import signal
    import subprocess

    from tierckpt.launcher.detect.wake import Waker

    before = signal.getsignal(signal.SIGCHLD)
    waker = Waker()
    try:
        assert waker.wait(0.05) is False  # nothing happened: the full timeout
        child = subprocess.Popen(["true"])
        assert waker.wait(30) is True, "a child's exit did not end the wait"
        child.wait()
        waker.wait(0)  # drain a second SIGCHLD, if any
        waker.notify()
        assert waker.wait(30) is True
    finally:
        waker.close()
    assert signal.getsignal(signal.SIGCHLD) == before


def test_a_log_rule_match_says_the_job_started() -> None:
    import re

    from tierckpt.launcher.detect.rules import RuleMonitor
    from tierckpt.launcher.jobspec import LogRule

    mon = RuleMonitor([LogRule(name="Start", log_pattern=re.compile(".*Loss:.*"))], 0.0)
    mon.feed("loading data", 1.0)
    assert not mon.matched
    mon.feed("Batch 1 Loss: 0.5", 2.0)
    assert mon.matched
