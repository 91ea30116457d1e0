"""``tierckpt bench scale --nodes 8,16``: the table and the goals print, every figure of ours exists,
and no simulation or store process is left. Timings are not judged here (the box is shared)."""

from __future__ import annotations

import multiprocessing
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
