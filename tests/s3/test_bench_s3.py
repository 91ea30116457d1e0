"""``tierckpt bench s3`` runs end to end on a tiny state: its own server, every method, checked loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierckpt.bench import s3 as bench_s3

pytestmark = [pytest.mark.s3, pytest.mark.slow]


def test_bench_s3_tiny_run_reports_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("s3torchconnector")
    out = tmp_path / "bench.json"
    assert bench_s3.main(["--size-mib", "8", "--tensors", "2", "--repeats", "1", "--part-size-mib", "5",
                          "--methods", "all", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["ratios"]) == {"save", "load"} and all(r > 0 for r in doc["ratios"].values())
    names = set(doc["figures"])
    assert {"tierckpt durable save (memory + S3)", "s3torchconnector DCP load", "boto3 multipart upload (s3transfer)"} <= names
    assert "tierckpt / s3torchconnector DCP save" in capsys.readouterr().out


def test_bench_s3_rejects_unknown_methods() -> None:
    with pytest.raises(SystemExit) as info:
        bench_s3.main(["--methods", "nope"])
    assert info.value.code == 2
