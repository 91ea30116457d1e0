"""``tierckpt bench scale --nodes 8,16``: the table and the goals print, every figure of ours exists,
and no simulation or store process is left. Timings are not judged here (the box is shared)."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import matplotlib.image as mpimg  # a dev requirement: --plot is tested, never skipped
import pytest

from tierckpt.bench import scale


@pytest.mark.slow  # ~30 s alone, minutes on a loaded box: torch's first rendezvous and two lost-node timeouts
def test_bench_scale_prints_the_table_and_the_goals(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    before = {p.pid for p in multiprocessing.active_children()}
    png = tmp_path / "scale.png"
    assert scale.main(["--nodes", "8,16", "--procs", "2", "--interval", "0.2", "--node-timeout", "1",
                       "--window", "0.5", "--rdzv-cap", "3", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("N | fault→stopped"))
    rows = {int(line.split(" | ")[0]): line.split(" | ") for line in lines[head + 1:head + 3]}
    assert sorted(rows) == [8, 16]
    for cells in rows.values():
        assert all(c.endswith(" s") and not c.startswith(">") for c in (cells[1], cells[2], cells[7], cells[8])), cells
        assert 1.5 <= float(cells[3]) <= 3.0  # ~2 operations per agent per interval, the watcher's few on top
        assert cells[9] == "> 3 s"  # torch's keep-alive alone (5 s x 3) outlasts the cap
    assert "load average" in out
    for goal in ("liveness traffic O(N)", "re-rendezvous after a lost node"):
        assert any(line.startswith("PASS") and goal in line for line in lines), goal
    assert {p.pid for p in multiprocessing.active_children()} <= before
    assert f"plot: {png}" in out
    assert mpimg.imread(png).shape[:2] == (400, 700)  # a PNG matplotlib reads back: 7 x 4 in at 100 dpi


def _rows() -> dict[int, dict[str, Any]]:
    return {64: {"ours": {"fault_all_stopped_s": 0.05, "restart_agreement_s": 0.06, "rerdzv_s": 0.11},
                 "torch": {"first_rdzv_s": 3.0, "rerdzv_s": 45.0}},
            256: {"ours": {"fault_all_stopped_s": 0.1, "restart_agreement_s": 0.14, "rerdzv_s": 0.14},
                  "torch": {"first_rdzv_s": None}},
            1024: {"ours": {"fault_all_stopped_s": 0.2, "restart_agreement_s": 0.6, "rerdzv_s": 1.7},
                   "torch": {}}}


def test_plot_series_put_torch_rounds_that_never_finished_at_the_cap() -> None:
    lines = scale.series(_rows(), 120.0)
    assert lines["fault → all stopped"] == [0.05, 0.1, 0.2]
    assert lines["restart agreement"] == [0.06, 0.14, 0.6]
    assert lines["re-rendezvous (ours)"] == [0.11, 0.14, 1.7]
    # 64: measured; 256: did not finish within the cap; 1024: not run (no point drawn)
    assert lines["re-rendezvous (torch c10d; 120 s = did not finish)"] == [45.0, 120.0, None]
    assert "re-rendezvous (torch c10d; 120 s = did not finish)" not in scale.series(
        {n: {**r, "torch": {}} for n, r in _rows().items()}, 120.0)


def test_plot_writes_a_png_with_every_line(tmp_path: Path) -> None:
    png = tmp_path / "out.png"
    assert scale._plot(_rows(), 120.0, str(png))
    img = mpimg.imread(png)
    assert img.shape[:2] == (400, 700)
    assert float(img[..., :3].std()) > 0.05  # not a blank canvas: axes, lines and the legend are drawn


def _descendants(pid: int) -> set[int]:
    """Every live process whose parent chain reaches ``pid`` (from /proc; reparented orphans are
    found by the session id instead, see the caller)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(") ", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.add(k)
            todo.append(k)
    return out


def _in_session(sid: int) -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(") ", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                out.add(int(d.name))
    return out


@pytest.mark.slow  # a bench process with its simulation processes: ~15 s per signal
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_signalled_bench_leaves_no_simulation_process(sig: str) -> None:
    """Killing ``tierckpt bench scale`` (SIGTERM: a job's end, Ctrl-C's kin; SIGKILL: an OOM kill) ends
    its store server and simulation processes too. Before the fix SIGTERM left them all running."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "tierckpt", "bench", "scale", "--nodes", "8", "--procs", "2",
                             "--no-torch", "--window", "600"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # its own session: orphans stay findable
    try:
        deadline = time.monotonic() + 120
        while len(_descendants(proc.pid)) < 3 and time.monotonic() < deadline:  # store + 2 simulation processes
            time.sleep(0.2)
        assert len(_descendants(proc.pid)) >= 3, "the bench never started its processes"
        time.sleep(2)  # inside the 600 s window: the simulated agents are beating
        proc.send_signal(getattr(signal, sig))
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _in_session(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:160] for p in _in_session(proc.pid)}
        assert not left, f"left after {sig}: {left}"
    finally:
        for pid in _in_session(proc.pid):  # ours: this session was made by this test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_simulated_agent_that_misses_the_next_generation_says_why() -> None:
    """Two simulated agents on a real TCPStore: a claim that counts node 1 lost while it runs;
    node 0 regroups alone, node 1 reports why it did not (the bench prints the reasons)."""
    import datetime
    import threading

    import torch.distributed as dist

    from tierckpt.bench.scale_sim import _Ours
    from tierckpt.launcher.control.jobcontrol import JobControl

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=False,  # type: ignore[attr-defined]
                           timeout=datetime.timedelta(seconds=30))
    ours = _Ours(server.port, [0, 1], 2, {"interval_s": 0.2, "node_timeout_s": 30.0, "store_timeout_s": 30.0},
                 threading.Lock())
    ours.start()
    try:
        JobControl(server).claim(0, {"reason": "LostNode", "node": 1, "lost": [1]})
        got = ours.generation(0, None)
        assert [node for node, _, _ in got["done"]] == [0]
        assert got["failed"] == {"counted lost": 1}
    finally:
        ours.close()
