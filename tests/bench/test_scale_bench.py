"""``tierckpt bench scale --nodes 8,16``: the table and the goals print, every figure of ours exists,
and no simulation or store process is left. Timings are not judged here (the box is shared)."""

from __future__ import annotations

import multiprocessing

import pytest

from tierckpt.bench import scale


@pytest.mark.slow  # ~30 s alone, minutes on a loaded box: torch's first rendezvous and two lost-node timeouts
def test_bench_scale_prints_the_table_and_the_goals(capsys: pytest.CaptureFixture[str]) -> None:
    before = {p.pid for p in multiprocessing.active_children()}
    assert scale.main(["--nodes", "8,16", "--procs", "2", "--interval", "0.2", "--node-timeout", "1",
                       "--window", "0.5", "--rdzv-cap", "3"]) == 0
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
