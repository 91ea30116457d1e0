"""``tierckpt bench replication`` end to end on a tiny step: every figure is produced, every
restore (peer, file://, S3 on a local SeaweedFS) gives the saved bytes back (the benchmark
checks that itself and exits 1 otherwise), goals are printed. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierckpt.bench.replication import main

pytestmark = pytest.mark.slow


def test_bench_replication_reports_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "repl.json"
    rc = main(["--size-mib", "4", "--rounds", "1", "--saves", "1", "--gap", "0", "--server-dir", str(tmp_path),
               "--json", str(out_json)])
    captured = capsys.readouterr()
    text = captured.out
    assert rc == 0, captured.out + captured.err
    for line in ("replication to a peer agent", "plain socket copy", "goal >= 0.9", "--insecure-wire", "restore from a peer replica",
                 "restore from durable file://", "restore from S3 (SeaweedFS)", "goal >= 5",
                 "save blocking, no agent", "save blocking, agents on", "<= 1.1"):
        assert line in text, line
    doc = json.loads(out_json.read_text())
    assert doc["bytes"] >= 4 << 20
    assert set(doc["median_s"]) == {"replication_s", "replication_insecure_s", "socket_copy_s", "restore_peer_s", "peer_fetch_s",
                                    "restore_durable_s", "restore_s3_s"}
    assert all(v > 0 for v in doc["median_s"].values())
    assert doc["restore_peer_vs_s3"] > 0 and doc["blocking"]["saves"] == 1
