"""``tierckpt bench data`` at a tiny size: every figure exists and every repositioned loader's first
batch is the batch of its position (the bench raises ``BenchError`` otherwise). Timings are not
judged here: the goals live in the benchmark (docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierckpt.bench import data


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_the_data_bench_measures_every_kind_and_cleans_up(tmp_path: Path) -> None:
    out_json = tmp_path / "data.json"
    assert data.main(["--samples", "96", "--sample-kib", "1", "--batch-size", "8", "--workers", "2",
                      "--rounds", "2", "--load-s", "0", "--dir", str(tmp_path), "--json", str(out_json)]) == 0
    out = json.loads(out_json.read_text())
    assert set(out["median"]) == set(data.KINDS) and all(v > 0 for v in out["median"].values())
    assert all(len(v) == 2 for v in out["times"].values())
    assert out["ratio_ahead"] == out["median"]["ahead"] / out["median"]["plain"]
    assert out["ratio_standby"] == out["median"]["standby"] / out["median"]["plain"]
    assert list(tmp_path.iterdir()) == [out_json]  # the sample files are gone
