"""Where an idle rank waits decides who is hung (issue 25, items 2 and the idle-evaluation defect):
the classification of the main thread's stack, the sampler on a real process, the hang rule on a
fake clock, and the wait board on a real store."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tierckpt import waitsample
from tierckpt.launcher.detect import hang
from tierckpt.launcher.detect.hang import Sample
from tierckpt.launcher.detect.heartbeat import BeatTracker, HeartbeatPolicy
from tierckpt.monitor import Beat
from tierckpt.waitsample import LIB, USER, classify, read_where


def _frame_in(filename: str, caller: tuple[str, int] | None = None) -> Any:
    """A frame whose code claims to live in ``filename``; with ``caller`` (file, line), called from
    a frame that claims to be that line of that file."""
    scope: dict[str, Any] = {}
    exec(compile("import sys\ndef inner():\n    return sys._getframe()\n", filename, "exec"), scope)  # noqa: S102
    if caller is None:
        return scope["inner"]()
    exec(compile("\n" * (caller[1] - 1) + "f = inner()", caller[0], "exec"), scope)  # noqa: S102
    return scope["f"]


def test_the_innermost_frame_tells_torch_from_user_code() -> None:
    site = os.path.join(os.sep, "venv", "lib", "python3.11", "site-packages")
    assert classify(_frame_in(os.path.join(site, "torch", "distributed", "distributed_c10d.py"))) == LIB
    assert classify(_frame_in(os.path.join(site, "tierckpt", "dcp", "writer.py"))) == LIB
    assert classify(_frame_in(os.path.join(site, "torch", "utils", "data", "dataloader.py"))) == USER
    assert classify(_frame_in("/home/me/train.py")) == USER
    assert classify(_frame_in(os.path.join(site, "tierckpt", "demo", "resilient.py"))) == USER  # a training loop
    assert classify(_frame_in("/usr/lib/python3.11/threading.py")) == USER
    assert classify(None) == USER
    assert (hang.USER_WAIT, hang.LIB_WAIT) == (USER, LIB)  # hang.py stays pure: same codes


def test_the_sampler_of_a_sleeping_process_says_user_and_goes_stale_when_it_ends(tmp_path: Path) -> None:
    code = ("import sys, time; from tierckpt import waitsample; waitsample.start(sys.argv[1], 3); "
            "time.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)])
    path = str(tmp_path / "where_3")
    try:
        deadline = time.monotonic() + 20
        while read_where(path) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_where(path) == USER
    finally:
        proc.kill()
        proc.wait()
    assert read_where(path, now=time.time() + waitsample.STALE_S + 1) is None
    assert read_where(str(tmp_path / "absent")) is None


def _idle_rank(seconds: float, **kw: object) -> tuple[float, tuple[str, str]] | None:
    """A rank that beat 10 times, then sits ``seconds`` without CPU; (silence, problem) at the first problem."""
    tr = BeatTracker(HeartbeatPolicy(), start=0.0)
    now = 0.0
    for seq in range(1, 11):
        now = round(now + 0.1, 6)
        tr.observe(Beat(seq=seq, step=seq, time=0.0, loss=1.0, non_finite=False), now)
    start = now
    while now - start < seconds:
        now = round(now + 0.1, 6)
        if tr.wants_sample(now):
            tr.evidence.add(Sample(now, 1.0, False, False, 0))
        problem = tr.check(now, **kw)  # type: ignore[arg-type]
        if problem is not None:
            return now - start, problem
    return None


def test_every_rank_idle_in_its_own_code_is_an_evaluation_not_a_hang_until_the_ceiling() -> None:
    assert _idle_rank(60, where=USER) is None  # the old rule fired at 5 s
    got = _idle_rank(400, where=USER)
    assert got is not None and got[0] == pytest.approx(300.0, abs=0.15) and "idle in its own code" in got[1][1], got


def test_a_rank_idle_in_its_own_code_while_others_wait_for_it_is_the_hang() -> None:
    got = _idle_rank(30, where=USER, peer_lib_wait=True)
    assert got is not None and 5.0 <= got[0] <= 5.2, got
    assert got[1][0] == "Hang" and "while rank(s) wait for it in a collective" in got[1][1], got


def test_a_rank_waiting_in_a_collective_for_one_stalled_in_its_own_code_is_not_blamed() -> None:
    assert _idle_rank(60, where=LIB, peer_user_wait=True) is None
    got = _idle_rank(30, where=LIB)  # every rank in a collective: a deadlock, at the idle limit as before
    assert got is not None and 5.0 <= got[0] <= 5.2 and got[1][1].startswith("no CPU or I/O progress"), got
    got = _idle_rank(30)  # no sampler (an old worker): as before
    assert got is not None and 5.0 <= got[0] <= 5.2, got


def test_wait_board_on_a_real_store() -> None:
    import torch.distributed as dist

    from tierckpt.launcher.control.store import connect_client
    from tierckpt.launcher.detect.busyboard import BusyBoard

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))  # type: ignore[attr-defined]
    a, b = BusyBoard(store, 0), BusyBoard(connect_client("127.0.0.1", store.port), 1)
    u, lib = (USER, 11), (LIB, 22)

    def by(board: BusyBoard, *args: Any, **kw: Any) -> dict[int, tuple[int, int]]:
        got = board.waits(*args, **kw)
        board.store.check(["sync"])  # a round trip on its connection: its set (no reply) has landed
        return got

    assert by(a, 2, 2, {}, ask=True) == {}  # nobody published (no blocking get)
    assert by(b, 2, 2, {1: u}, ask=False) == {}  # published, not asked
    assert by(a, 2, 2, {0: lib}, ask=True) == {1: u}
    assert by(b, 2, 2, {1: u}, ask=True) == {0: lib}
    assert by(a, 3, 2, {}, ask=True) == {}  # per generation
    assert by(b, 2, 2, {}, ask=True) == {0: lib}  # b's own key cleared; a still waits in torch
    assert by(a, 2, 2, {}, ask=True) == {}
    assert by(a, 2, 1, {}, ask=True) == {}  # one node: nobody else
    assert by(b, 4, 2, {1: u, 5: (LIB, 4294967295)}, ask=False) == {}  # several ranks, a 32-bit site
    assert by(a, 4, 2, {}, ask=True) == {1: u, 5: (LIB, 4294967295)}


def test_the_site_tells_apart_two_waits_in_the_same_library_call() -> None:
    """Two frames inside torch called from different user lines have different sites; the same
    line has the same site; a USER frame's site is its own line."""
    from tierckpt.waitsample import site

    lib = os.path.join(os.sep, "venv", "site-packages", "torch", "distributed", "distributed_c10d.py")
    first, again, other = (_frame_in(lib, caller=("/home/me/train.py", line)) for line in (10, 10, 12))
    assert site(first) == site(again) != site(other) != 0
    assert site(None) == 0
    assert site(_frame_in("/home/me/train.py")) != site(first)


def test_odd_ones_are_the_ranks_that_wait_where_the_majority_does_not() -> None:
    from tierckpt.launcher.decide.diagnose import odd_ones

    ar, recv = (LIB, 1), (LIB, 2)
    assert odd_ones({0: ar, 1: recv, 2: ar}) == {1}
    assert odd_ones({0: ar, 1: recv, 2: ar, 3: ar, 4: (USER, 9)}) == {1, 4}
    assert odd_ones({0: ar, 1: recv}) == frozenset()  # two ranks: no majority
    assert odd_ones({0: ar, 1: recv, 2: (LIB, 3), 3: (LIB, 4)}) == frozenset()  # all differ
    assert odd_ones({0: ar, 1: ar, 2: recv, 3: recv}) == frozenset()  # a tie
    assert odd_ones({0: ar, 1: ar, 2: ar}) == frozenset()  # all alike: a deadlock with no odd one


def _stack(*files: str) -> Any:
    """The innermost frame of a call chain through ``files`` (outermost first), each frame's code
    claiming to live in its file."""
    scope: dict[str, Any] = {"sys": sys}
    for i, name in enumerate(reversed(files)):  # innermost first: each calls the one defined before it
        body = "    return sys._getframe()\n" if i == 0 else f"    return f{i - 1}()\n"
        exec(compile(f"def f{i}():\n{body}", name, "exec"), scope)  # noqa: S102
    return scope[f"f{len(files) - 1}"]()


def test_where_a_whole_stack_waits_skips_the_standard_library() -> None:
    import threading

    from tierckpt.waitsample import SAVE, where

    site_pkgs = os.path.join(os.sep, "venv", "lib", "python3.11", "site-packages")
    torch_c10d = os.path.join(site_pkgs, "torch", "distributed", "distributed_c10d.py")
    ckpt = os.path.join(site_pkgs, "tierckpt", "checkpointer.py")
    s3_retry = os.path.join(site_pkgs, "tierckpt", "tiers", "s3_retry.py")
    resilient = os.path.join(site_pkgs, "tierckpt", "inprocess.py")
    stdlib_threading = threading.__file__
    train = "/home/me/train.py"
    assert where(_stack(train, stdlib_threading)) == USER  # the user's own Event.wait
    assert where(_stack(train, torch_c10d)) == LIB  # a collective
    assert where(_stack(train, ckpt, stdlib_threading)) == SAVE  # ck.wait() on a save in flight
    assert where(_stack(train, ckpt, s3_retry)) == SAVE  # a synchronous save's S3 backoff
    assert where(_stack(train, ckpt, torch_c10d)) == SAVE  # a save's own collective
    assert where(_stack(resilient, train, torch_c10d)) == LIB  # under tierckpt.resilient: still the user's collective
    assert where(_stack(resilient, train)) == USER
    assert where(None) == USER


def test_a_save_waiting_on_storage_is_no_hang_and_neither_are_the_ranks_waiting_for_it() -> None:
    from tierckpt.waitsample import SAVE

    got = _idle_rank(400, where=SAVE)
    assert got is not None and got[0] == pytest.approx(300.0, abs=0.15) and "checkpoint's storage" in got[1][1], got
    got = _idle_rank(400, where=LIB, peer_save_wait=True)
    assert got is not None and got[0] == pytest.approx(300.0, abs=0.15), got
