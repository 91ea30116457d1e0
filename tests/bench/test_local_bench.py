"""``tierckpt bench`` (local) at a tiny size: every method runs, round trips verify, nothing is left.

Timings are not judged here (goals live in the benchmark); only that each figure exists,
is positive, and that the run cleaned up after itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tierckpt.bench import local, methods
from tierckpt.bench.measure import RssProbe, VerificationError, check_equal
from tierckpt.bench.runner import TIMED

FIGURES = {
    "memcpy_numpy": {"copy"},
    "memcpy_torch": {"copy"},
    "torch_save": {"save", "load"},
    "dcp_fs": {"save", "load"},
    "dcp_async": {"blocking", "save"},
    "tierckpt": {"blocking", "save", "load"},
    "tierckpt_dcp": {"save", "load"},
    "paired": {"copy", "blocking", "save", "dcp_save", "load", "dcp_load"},
    "training": {"copy", "step_nosave", "step_blocking", "step_overlap", "stall_blocking", "stall_overlap",
                 "fence_overlap"},
    "first_saves": {"first", "reserve", "later", "later_max"},
}
NO_RSS = {"training", "first_saves"}  # timed inside a loop: no RSS probe
WARMUPS = {"tierckpt": 2, "tierckpt_dcp": 2, "paired": 2, "training": 2}
TINY = ["--size-mib", "8", "--tensors", "4", "--repeats", "1", "--leak-mib", "8", "--leak-saves", "8"]


def _run(shm_root: Path, tmp_path: Path, world_size: int, capsys: pytest.CaptureFixture[str]) -> dict:
    out = tmp_path / "bench.json"
    rc = local.main([*TINY, "--world-size", str(world_size), "--shm-dir", str(shm_root), "--json", str(out)])
    printed, err = capsys.readouterr()
    assert rc == 0, printed + err
    assert "goals" in printed and "tierckpt Checkpointer.load from memory" in printed
    # a line per method as it finishes, before the table
    assert printed.index("done memcpy_numpy:") < printed.index("done training:") < printed.index("figure ")
    assert list(shm_root.iterdir()) == [], "the run left files in its shm directory"
    return json.loads(out.read_text())


def _check(doc: dict, world_size: int) -> None:
    assert set(FIGURES) == set(TIMED)
    assert doc["config"]["world_size"] == world_size
    for method, figures in FIGURES.items():
        assert {k.split(".")[1] for k in doc["figures"] if k.startswith(method + ".")} >= figures, method
        for fig in figures:
            f = doc["figures"][f"{method}.{fig}"]
            assert len(f["runs_s"]) == 1 and all(s > 0 for s in f["runs_s"]), (method, fig)
            assert f["median_s"] > 0 and f["gb_per_s"] > 0
            if method not in NO_RSS:
                assert f["rss_extra_bytes"] is not None and f["rss_extra_bytes"] >= 0
            assert len(f["warmup_s"]) == WARMUPS.get(method, 1), (method, fig)
    assert doc["failures"] == {}
    assert doc["checks"] == {"tierckpt.snapshot": True, "training.overlap_snapshot": True}
    assert len(doc["leak"]["rss_anon_after_each"]) == 8
    assert len(doc["leak"]["dcp_fs_rss_anon_after_each"]) == 8
    # every goal was measurable in this run (a PASS or MISS, never n/a)
    assert len(doc["goals"]) == 10 and all(g["pass"] is not None for g in doc["goals"])
    names = " ".join(g["goal"] for g in doc["goals"])
    assert "visible stall" in names and "no save after the first" in names and "overlapped save is a snapshot" in names


# capfd, not capsys: with two ranks the progress lines come from rank 0's own process
@pytest.mark.slow  # 20-33 s on the loaded 2-core box: a fresh interpreter with torch, or a seed round-trip
def test_bench_one_rank(shm_root: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    _check(_run(shm_root, tmp_path, 1, capfd), 1)


@pytest.mark.slow
def test_bench_two_ranks(shm_root: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    doc = _run(shm_root, tmp_path, 2, capfd)
    _check(doc, 2)
    assert doc["env"]["torch_threads"] == 1


def test_methods_subset(shm_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "b.json"
    rc = local.main([*TINY, "--methods", "memcpy_numpy,dcp_fs", "--shm-dir", str(shm_root), "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc["figures"]) == {"memcpy_numpy.copy", "dcp_fs.save", "dcp_fs.load"}
    assert "n/a" in capsys.readouterr().out  # goals without their figures are not judged


def test_leak_check_follows_the_state_size(shm_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    rc = local.main(["--size-mib", "6", "--tensors", "4", "--methods", "leak", "--leak-saves", "6",
                     "--shm-dir", str(shm_root), "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["leak_state_bytes"] == doc["config"]["state_bytes"] == 6 * 2**20
    assert doc["leak"]["state_bytes"] == 6 * 2**20 and doc["leak"]["saves"] == 6


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        local.main(["--methods", "memcpy,nope"])
    assert exc.value.code == 2
    assert "nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        local.main(["--size-mib", "1", "--tensors", "4096"])


def test_a_bad_round_trip_is_reported_and_the_run_goes_on(
    shm_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def corrupting_copy(dst: list, src: list) -> None:
        for d, x in zip(dst, src, strict=True):
            d[...] = x
        dst[-1].flat[3] += 1.0

    monkeypatch.setattr(methods, "_copyto_all", corrupting_copy)
    out = tmp_path / "b.json"
    rc = local.main([*TINY, "--methods", "memcpy_numpy,memcpy_torch", "--shm-dir", str(shm_root), "--json", str(out)])
    assert rc == 1
    doc = json.loads(out.read_text())
    assert "tensor 3 differs" in doc["failures"]["memcpy_numpy"]
    assert set(doc["figures"]) == {"memcpy_torch.copy"}
    assert "FAILED memcpy_numpy" in capsys.readouterr().out


def test_check_equal_catches_one_flipped_value() -> None:
    a = [torch.arange(16, dtype=torch.float32), torch.ones(4)]
    b = [t.clone() for t in a]
    check_equal(a, b, "same")
    b[0][7] = -b[0][7]
    with pytest.raises(VerificationError, match="tensor 0"):
        check_equal(a, b, "flipped")


def test_rss_probe_sees_an_allocation() -> None:
    with RssProbe() as probe:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    del block
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("VmHWM cannot be reset here")
    assert probe.source == "hwm"
    assert probe.extra is not None and probe.extra >= 60 * 2**20
