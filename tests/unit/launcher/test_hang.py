"""The hang policy on a fake clock (beats and /proc samples fed in), the section record, and /proc sampling
of real processes."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import tierckpt.monitor as monitor
from tierckpt.launcher.detect.hang import HangPolicy, Profile, Sample
from tierckpt.launcher.detect.heartbeat import BeatTracker, HeartbeatPolicy
from tierckpt.launcher.detect.procwatch import sample_ranks, sample_tree
from tierckpt.monitor import Beat, read_beat

TICK = 0.1  # the agent's poll


class Rank:
    """A tracker driven like the agent drives it: a beat or a sample each poll, then ``check``."""

    def __init__(self, policy: HeartbeatPolicy | None = None, learned: Profile | None = None) -> None:
        self.tr = BeatTracker(policy or HeartbeatPolicy(), start=0.0, learned=learned)
        self.now, self.seq, self.step, self.cpu, self.io = 0.0, 0, 0, 0.0, 0

    def beat(self, section: tuple[str, float | None] | None = None) -> None:
        self.seq += 1
        self.step += 1
        name, timeout = section if section is not None else (None, None)
        self.tr.observe(Beat(seq=self.seq, step=self.step, time=0.0, loss=1.0, non_finite=False,
                             section=name, section_timeout_s=timeout), self.now)

    def silent(self, seconds: float, *, cpu_rate: float, active: bool, stopped: bool = False,
               peer_busy: bool = False, io_rate: int = 0) -> tuple[float, tuple[str, str]] | None:
        """``seconds`` of polls without a beat; (silence, problem) at the first problem, else None."""
        start = self.now
        while self.now - start < seconds - 1e-9:
            self.now = round(self.now + TICK, 6)
            self.cpu += 0.0 if stopped else cpu_rate * TICK
            self.io += 0 if stopped else int(io_rate * TICK)
            if self.tr.wants_sample(self.now):
                self.tr.evidence.add(Sample(self.now, self.cpu, stopped, active and not stopped, self.io))
            problem = self.tr.check(self.now, peer_busy=peer_busy)
            if problem is not None:
                return self.now - start, problem
        return None

    def train(self, steps: int, *, every: int = 0, slow_s: float = 0.0, slow_cpu: float = 1.0,
              slow_active: bool = True) -> None:
        """``steps`` 0.1 s steps; every ``every``-th one takes ``slow_s`` instead. Fails at any problem."""
        for i in range(1, steps + 1):
            slow = every and i % every == 0
            got = self.silent(slow_s if slow else TICK, cpu_rate=slow_cpu if slow else 0.5,
                              active=slow_active if slow else True)
            assert got is None, (i, got)
            self.beat()


def test_eval_pass_every_25_steps_is_never_a_hang_and_is_remembered() -> None:
    r = Rank()
    r.beat()
    r.train(100, every=25, slow_s=8.0)  # the job: 0.1 s steps, an 8 s evaluation every 25th
    assert r.tr.profile.longest_s == pytest.approx(8.0) and r.tr.profile.intervals == 100
    # the next generation starts from what was learned: calibrated at its first beat, same answer
    again = Rank(learned=Profile.from_dict(r.tr.profile.to_dict()))
    again.beat()
    assert again.tr.calibrated and again.tr.timeout() == pytest.approx(24.0)
    again.train(30, every=25, slow_s=8.0)


def test_stopped_process_is_a_hang_within_5s_naming_it() -> None:
    r = Rank()
    r.beat()
    r.train(10)
    silence, (reason, detail) = r.silent(30, cpu_rate=0.0, active=False, stopped=True) or (0.0, ("", ""))
    assert reason == "Hang" and silence <= 4.0, (silence, detail)
    assert detail.startswith("process stopped (state T) for 3.") and "after its last heartbeat at step 11" in detail


def test_no_cpu_progress_is_a_hang_at_the_idle_limit() -> None:
    r = Rank()
    r.beat()
    r.train(10)
    silence, (reason, detail) = r.silent(30, cpu_rate=0.0, active=False) or (0.0, ("", ""))
    assert reason == "Hang" and 5.0 <= silence <= 5.2 and detail.startswith("no CPU or I/O progress for 4."), detail


def test_idle_while_another_rank_is_busy_waits_for_it_up_to_the_ceiling() -> None:
    r = Rank()
    r.beat()
    r.train(10)
    silence, (reason, detail) = r.silent(400, cpu_rate=0.0, active=False, peer_busy=True) or (0.0, ("", ""))
    assert reason == "Hang" and silence == pytest.approx(300.0, abs=0.15), silence  # the ceiling's floor
    assert "waiting for a busy rank (ceiling 300s)" in detail
    # waiting 8 s for another rank's evaluation is not learned as a stall of this rank's own
    w = Rank()
    w.beat()
    w.train(5)
    assert w.silent(8.0, cpu_rate=0.0, active=False, peer_busy=True) is None
    w.beat()
    assert w.tr.profile.longest_idle_s == 0.0 and w.tr.profile.longest_s == pytest.approx(8.0)
    got = w.silent(30, cpu_rate=0.0, active=False)
    assert got is not None and got[0] == pytest.approx(5.0, abs=0.15)


def test_a_starved_busy_rank_on_a_loaded_machine_is_not_idle() -> None:
    """Runnable (R) in every sample but almost no CPU: the machine is loaded, the rank is not hung."""
    r = Rank()
    r.beat()
    r.train(5)
    assert r.silent(60, cpu_rate=0.001, active=True) is None


def test_a_stall_that_moves_bytes_is_not_idle() -> None:
    """A data loader waiting on a remote bucket: no CPU to speak of, sleeping threads, but bytes arrive."""
    r = Rank()
    r.beat()
    r.train(5)
    assert r.silent(60, cpu_rate=0.001, active=False, io_rate=200_000) is None
    got = r.silent(30, cpu_rate=0.0, active=False, io_rate=1000)  # a trickle is no progress
    assert got is not None and "no CPU or I/O progress" in got[1][1]


def test_busy_without_a_beat_ends_at_the_ceiling() -> None:
    r = Rank(learned=Profile(longest_s=40.0, intervals=10))
    r.beat()
    assert r.silent(399.0, cpu_rate=1.0, active=True) is None  # 10 x 40 s
    silence, (_, detail) = r.silent(5, cpu_rate=1.0, active=True) or (0.0, ("", ""))
    assert "while busy (ceiling 400s)" in detail
    fixed = Rank(HeartbeatPolicy(hang=HangPolicy(ceiling_s=20.0)))  # --hang-ceiling 20
    fixed.beat()
    silence, _ = fixed.silent(60, cpu_rate=1.0, active=True) or (0.0, ("", ""))
    assert silence == pytest.approx(20.0, abs=0.15)


def test_an_idle_stall_seen_before_raises_the_idle_limit() -> None:
    """A data-loader stall of 4 s with no CPU, seen once, is normal from then on (limit 2 x 4 s)."""
    r = Rank()
    r.beat()
    r.train(5)
    assert r.silent(4.0, cpu_rate=0.0, active=False) is None
    r.beat()
    assert r.tr.profile.longest_idle_s == pytest.approx(3.5, abs=0.15)  # sampled from 0.5 s of silence on
    assert r.silent(6.5, cpu_rate=0.0, active=False) is None
    r.beat()
    got = r.silent(30, cpu_rate=0.0, active=False)
    assert got is not None and got[0] == pytest.approx(2 * 6.0, abs=0.2), got


def test_section_has_its_own_deadline_but_a_stopped_process_is_still_a_hang() -> None:
    r = Rank()
    r.beat()
    r.train(5)
    r.beat(section=("eval", 20.0))
    assert r.silent(19.9, cpu_rate=0.0, active=False) is None  # idle in the section: allowed
    silence, (_, detail) = r.silent(1.0, cpu_rate=0.0, active=False) or (0.0, ("", ""))
    assert detail.startswith("in section 'eval' for 20.1s, past its timeout_s=20")
    s = Rank()
    s.beat(section=("eval", 600.0))
    got = s.silent(10, cpu_rate=0.0, active=False, stopped=True)
    assert got is not None and "stopped" in got[1][1]
    s.beat()  # leaving: the section's interval is not learned as a step
    assert s.tr.profile.longest_s == 0.0 and s.tr.section is None


def test_fixed_timeout_ignores_evidence_and_profile_survives_bad_input() -> None:
    r = Rank(HeartbeatPolicy(fixed_timeout_s=2.0))
    r.beat()
    got = r.silent(10, cpu_rate=1.0, active=True)
    assert got is not None and got[0] == pytest.approx(2.1, abs=0.05) and "no heartbeat" in got[1][1]
    assert Profile.from_dict({"longest_s": "x"}) == Profile() == Profile.from_dict(None)
    assert Profile.from_dict({"longest_s": math.inf, "longest_idle_s": 0, "intervals": 1}) == Profile()
    with pytest.raises(ValueError, match="--hang-ceiling"):
        HangPolicy(ceiling_s=0)


def test_section_records_round_trip_and_stay_readable_as_old_records(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPT_MONITOR_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(monitor, "_writer_pid", None)
    path = str(tmp_path / "beat_0")
    monitor.step(3, loss=0.5)
    with monitor.section("eval", timeout_s=90):
        b = read_beat(path)
        assert b is not None and (b.step, b.section, b.section_timeout_s) == (3, "eval", 90.0)
        with monitor.section("save"):
            b = read_beat(path)
            assert b is not None and (b.section, b.section_timeout_s) == ("save", None)
        monitor.step(4, loss=0.25)
        b = read_beat(path)
        assert b is not None and (b.step, b.section) == (4, "eval")
        # an old reader: the first 44 bytes are the old record, unchanged
        seq, step, _, loss, _, _ = monitor._REC.unpack(Path(path).read_bytes()[: monitor._REC.size])
        assert (seq, step, loss) == (b.seq, 4, 0.25)
    b = read_beat(path)
    assert b is not None and b.section is None and b.step == 4
    with pytest.raises(ValueError, match="timeout_s"), monitor.section("eval", timeout_s=-1):
        pass
    with pytest.raises(ValueError, match="1 to 32 bytes"), monitor.section("x" * 33):
        pass


def _child(code: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(0.5)  # let the interpreter start before it is sampled
    return proc


def test_sample_tree_tells_stopped_idle_and_busy_apart() -> None:
    idle = _child("import time; time.sleep(60)")
    busy = _child("while True: pass")
    try:
        a, b = sample_tree(idle.pid, 0.0), sample_tree(busy.pid, 0.0)
        time.sleep(0.5)
        a2, b2 = sample_tree(idle.pid, 0.5), sample_tree(busy.pid, 0.5)
        assert a and a2 and b and b2
        assert not a2.active and not a2.stopped and a2.cpu_s - a.cpu_s <= 0.02
        assert b2.cpu_s > b.cpu_s or b2.active
        os.kill(busy.pid, signal.SIGSTOP)
        time.sleep(0.2)
        s = sample_tree(busy.pid, 1.0)
        assert s is not None and s.stopped and not s.active
        parent = _child("import subprocess, sys; subprocess.run([sys.executable, '-c', 'while True: pass'])")
        try:
            time.sleep(0.5)
            p1 = sample_tree(parent.pid, 0.0)
            time.sleep(0.5)
            p2 = sample_tree(parent.pid, 0.5)
            assert p1 and p2 and p2.cpu_s - p1.cpu_s >= 0.05  # the child's CPU counts for the rank
        finally:
            for pid in [int(c) for c in Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()]:
                os.kill(pid, signal.SIGKILL)
            parent.kill()
            parent.wait()
    finally:
        for proc in (idle, busy):
            proc.kill()
            proc.wait()
    assert sample_tree(idle.pid, 2.0) is None


def test_sample_ranks_samples_only_silent_ranks_and_names_busy_peers() -> None:
    busy = _child("while True: pass")
    try:
        trackers = {0: BeatTracker(HeartbeatPolicy(), start=0.0), 1: BeatTracker(HeartbeatPolicy(), start=0.0)}
        for tr in trackers.values():
            tr.observe(Beat(seq=1, step=1, time=0.0, loss=1.0, non_finite=False), 0.0)
        asked = []
        out = sample_ranks(trackers, {0: busy.pid, 1: os.getpid()}, 0.2, lambda b, a: asked.append((b, a)) or False)
        assert not trackers[0].evidence.samples and out == {0: False, 1: False}  # not silent long enough
        for i in range(12):
            time.sleep(0.1)
            out = sample_ranks(trackers, {0: busy.pid}, 1.0 + i * 0.1, lambda b, a: asked.append((b, a)) or False)
        assert trackers[0].busy_silent() and out == {0: False, 1: True}  # 1 waits for 0, which computes
        assert asked[0] == (False, False) and asked[-1] == (True, False)  # published; nobody idle to ask for
        assert sample_ranks(trackers, {0: busy.pid}, 2.3, lambda b, a: True) == {0: True, 1: True}
    finally:
        busy.kill()
        busy.wait()


def test_hang_ceiling_option() -> None:
    from tierckpt.errors import TierckptError
    from tierckpt.launcher.cli import _options, build_parser

    def opts(*argv: str) -> HeartbeatPolicy:
        return _options(build_parser().parse_args([*argv, "train.py"])).heartbeat  # type: ignore[no-any-return]

    assert opts().hang == HangPolicy() and opts().fixed_timeout_s is None  # auto: the evidence rules
    assert opts("--hang-ceiling", "120").hang.ceiling_s == 120.0
    with pytest.raises(TierckptError, match="--hang-ceiling must be positive"):
        opts("--hang-ceiling", "0")


def test_busy_board_on_a_real_store() -> None:
    import datetime

    import torch.distributed as dist

    from tierckpt.launcher.control.store import connect_client
    from tierckpt.launcher.detect.busyboard import BusyBoard

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))  # type: ignore[attr-defined]
    a, b = BusyBoard(store, 0), BusyBoard(connect_client("127.0.0.1", store.port), 1)

    def by(board: BusyBoard, *args: Any) -> bool:
        got = board.exchange(*args)
        board.store.check(["sync"])  # a round trip on its connection: its set (no reply) has landed
        return got

    assert not by(a, 3, 2, False, True)  # nobody published: not busy (and no blocking get)
    assert not by(b, 3, 2, True, False)  # published, not asked
    assert by(a, 3, 2, False, True) and not by(a, 4, 2, False, True)  # per generation
    assert not by(b, 3, 2, False, True)  # its own key does not count
    assert not by(a, 3, 2, False, True)  # b is no longer busy
    assert not by(a, 3, 1, False, True)  # one node: nobody else
