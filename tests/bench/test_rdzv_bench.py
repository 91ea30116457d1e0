"""``tierckpt bench rdzv`` at 8 simulated nodes: every phase reports sane figures, the ranks are a
permutation, the spare holds the lost node's rank, and no simulation or store process is left.
Timings are judged loosely only (the box is shared): each phase well under its limit."""

from __future__ import annotations

import argparse
import multiprocessing
from pathlib import Path

import matplotlib.image as mpimg  # a dev requirement, as for bench scale
import pytest

from tierckpt.bench import rdzv


def _args(**kw: object) -> argparse.Namespace:
    a = dict(procs=2, sim="greenlets", interval=0.1, window=0.5, poll=0.01, join_timeout=60.0, claims_max=64, torch_max=0,
             rdzv_cap=5.0, torch_conf="", libuv=True, plot=None)
    a.update(kw)
    return argparse.Namespace(**a)


def test_the_store_server_is_the_jobs_own_libuv_server_unless_asked() -> None:
    """The job store a user gets is c10d's (TCPStore's default: libuv); the bench measures that one."""
    import torch.distributed as dist

    assert rdzv.parser().parse_args([]).libuv is True
    assert rdzv.parser().parse_args(["--legacy-store"]).libuv is False
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    assert store.libuvBackend is True, "torch's default store server changed: re-check the bench's default"


@pytest.mark.parametrize("sim", ["greenlets", "threads"])
def test_eight_agents_form_a_round_poll_steadily_and_re_form_with_the_spare(sim: str) -> None:
    """Either simulation (greenlets on the pure-Python client, or threads on torch's) runs the real
    handler to the same figures."""
    before = {p.pid for p in multiprocessing.active_children()}
    got = rdzv.run_n(8, _args(sim=sim))
    assert "error" not in got, got
    first, lost = got["first"], got["lost"]
    assert first["ranks_ok"] and not first["failed"]
    assert 0 <= first["s"] <= first["ranked_s"] < 10 and 0 <= first["spread_s"] < 10
    assert first["store_cpu"] >= 0 and first["sim_cpu"] >= 0
    # at max_nodes the handler answers alone, and beats the running job once a second (5 polls of 0.1 s here)
    assert 0 < got["steady_at_max"]["ops_per_node_interval"] <= 0.25
    assert 1.0 <= got["steady_below_max"]["ops_per_node_interval"] <= 1.25  # one add per poll, and the beat
    assert got["steady_below_max"]["intervals"] >= 2
    assert lost["handler_ranks_ok"] and not lost["failed"]
    assert lost["spare_holds_lost_rank"], "the survivors keep their ranks, the spare takes the lost one's"
    assert 0 <= lost["arrived_s"] <= lost["reformed_s"] <= lost["ranked_s"] < 20
    assert lost["ranked_s"] == lost["reformed_s"], "the round decided the ranks itself: no exchange after it"
    alone = got["alone"]  # the decision timed with the simulator idle: both rounds decided, ranks as claimed
    for name in ("first", "lost"):
        assert alone[name]["ok"], alone
        assert all(0 < alone[name][k] < 10 for k in ("lead_s", "member_s", "exchange_s")), alone
    assert {p.pid for p in multiprocessing.active_children()} <= before


def test_table_goals_and_series_read_every_figure(tmp_path: Path) -> None:
    ours = {"first": {"s": 0.01, "spread_s": 0.02, "ranks_ok": True, "failed": {}, "store_cpu": 0.1, "sim_cpu": 0.5},
            "steady_at_max": {"ops_per_node_interval": 0.0, "store_cpu": 0.0},
            "steady_below_max": {"ops_per_node_interval": 1.0, "store_cpu": 0.2},
            "lost": {"reformed_s": 0.05, "ranked_s": 0.2, "spare_holds_lost_rank": True, "handler_ranks_ok": True,
                     "failed": {}, "store_cpu": 0.3, "sim_cpu": 0.6}}
    slow = {**ours, "lost": {**ours["lost"], "ranked_s": 9.0}}
    rows = {64: {"ours": ours, "torch": {"first_rdzv_s": 2.5, "rerdzv_s": None}},
            1024: {"ours": slow, "torch": {}}}
    text = rdzv.table(rows, 60.0)
    assert "0.010 s" in text and "0.200 s (yes)" in text and "> 60 s" in text and "not run" in text
    lines = rdzv.goals(rows)
    assert any(x.startswith("PASS") and "64 nodes: first rendezvous" in x for x in lines)
    assert any(x.startswith("MISS") and "1024 nodes: lost node" in x for x in lines)
    assert any(x.startswith("N/A") and "4096" in x for x in lines)
    assert any(x.startswith("PASS") and "O(1)" in x for x in lines)
    lines_ = rdzv.series(rows, 60.0)
    assert lines_["first rendezvous (tierckpt)"] == [0.01, 0.01]
    assert lines_["lost node → re-rendezvous (torch c10d; 60 s = did not finish)"] == [60.0, None]
    png = tmp_path / "rdzv.png"
    assert rdzv.plot_lines([64, 1024], lines_, "t", str(png))
    assert mpimg.imread(png).shape[:2] == (400, 700)
