"""The restart-state file's durable copy is read back on a fresh machine (issue 24, item 5):
``runstate.load`` takes the node-local copy, else the ``file://`` durable one (S3: tests/s3)."""

from __future__ import annotations

from pathlib import Path

from tierckpt.launcher.options import RunOptions
from tierckpt.launcher.supervisor import runstate

STATE = {"next_generation": 7, "full_restarts": 2, "restarts": 6, "job_started": 1_700_000_000.5,
         "resume_before": 41, "unhealthy_before": 3, "offenses": {"host-a:/dev/shm/x": [1_700_000_100.0]},
         "hang": {"longest_s": 4.2, "longest_idle_s": 1.0, "intervals": 40}}


def _opts(memory: Path, durable: Path) -> RunOptions:
    return RunOptions(memory_dir=str(memory), durable_url=f"file://{durable}", namespace="run1")


def test_a_fresh_machine_reads_the_durable_copy(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    old, fresh = tmp_path / "old-node", tmp_path / "new-node"
    assert runstate.save(_opts(old, durable), "job", STATE) is None
    assert (durable / "run1" / runstate.STATE_DIR / "job.json").exists()
    fresh.mkdir()
    assert runstate.load(_opts(fresh, durable), "job") == STATE
    # without the durable tier the fresh machine knows nothing
    assert runstate.load(RunOptions(memory_dir=str(fresh)), "job") == {}


def test_the_local_copy_wins_when_there_is_one(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    a, b = tmp_path / "a", tmp_path / "b"
    runstate.save(_opts(a, durable), "job", STATE)
    runstate.save(_opts(b, durable), "job", {**STATE, "next_generation": 8})  # the durable copy is b's now
    assert runstate.load(_opts(a, durable), "job")["next_generation"] == 7
    assert runstate.load(_opts(tmp_path / "c", durable), "job")["next_generation"] == 8


def test_a_damaged_local_copy_falls_back_to_the_durable_one(tmp_path: Path) -> None:
    durable, node = tmp_path / "durable", tmp_path / "node"
    runstate.save(_opts(node, durable), "job", STATE)
    (node / runstate.STATE_DIR / "job.json").write_text("{not json")
    assert runstate.load(_opts(node, durable), "job") == STATE


def test_a_durable_copy_that_cannot_be_written_is_reported_not_raised(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    durable.write_text("a file where the durable directory should be")
    problem = runstate.save(_opts(tmp_path / "node", durable), "job", STATE)
    assert problem is not None and "durable copy of the restart state was not written" in problem
    assert runstate.load(RunOptions(memory_dir=str(tmp_path / "node")), "job") == STATE  # the local copy holds
