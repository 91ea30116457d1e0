"""``tierckpt bench recovery`` on the crash scenario, one round (warm, cold, torchrun): every figure
exists, nothing is left.

Timings are not judged here (the goals live in the benchmark's report); only that each
figure is there and positive, the stages add up, and the run cleaned up after itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tierckpt.bench import recovery


def _processes_naming(mark: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if mark.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_crash_round(shm_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, logs = tmp_path / "recovery.json", tmp_path / "logs"
    rc = recovery.main(["--rounds", "1", "--scenarios", "crash", "--shm-dir", str(shm_root),
                        "--logs", str(logs), "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    goals = printed.split("goals")[1]
    assert "warm <= 0.3 x torchrun" in goals and "cold <= 0.5 x torchrun" in goals and "hang" not in goals
    doc = json.loads(out.read_text())
    crash = doc["figures"]["crash"]
    for launcher in ("warm", "cold", "torchrun"):
        assert crash[launcher]["median_s"] > 0 and len(crash[launcher]["runs_s"]) == 1
        assert crash[launcher]["worker_start_s"]["median_s"] > 0
    assert crash["ratio"]["warm"] > 0 and crash["ratio"]["cold"] > 0
    for mode in ("warm", "cold"):
        stages = {k: v["median_s"] for k, v in crash[mode]["stages_s"].items()}
        assert set(stages) == set(recovery.STAGES), stages
        assert sum(stages.values()) == pytest.approx(crash[mode]["median_s"], abs=1e-3)
    runs = {r["launcher"]: r for r in doc["runs"]}
    assert runs["warm"]["warm_ranks"] == [0, 1] and runs["cold"]["warm_ranks"] == []  # who served the restart
    for run in doc["runs"]:  # both ranks resumed the same committed step under every launcher
        assert len(set(run["resumed_step"].values())) == 1 and None not in run["resumed_step"].values(), run
    assert doc["failures"] == [] and [g["pass"] is not None for g in doc["goals"]] == [True, True]
    assert list(shm_root.iterdir()) == [], "the run left memory tiers behind"
    assert _processes_naming(str(logs)) == [], "the run left launchers or workers running"


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        recovery.main(["--scenarios", "crash,nope"])
    assert exc.value.code == 2
    assert "nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        recovery.main(["--rounds", "0"])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_nan_and_lost_node_round(shm_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One round of the nan and lostnode scenarios: after the NaN every rank resumes a step older than
    the NaN step; after the host loss the job resumes from the lost node's replica, not from step 0."""
    out, logs = tmp_path / "recovery.json", tmp_path / "logs"
    rc = recovery.main(["--rounds", "1", "--scenarios", "nan,lostnode", "--shm-dir", str(shm_root),
                        "--logs", str(logs), "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    doc = json.loads(out.read_text())
    runs = {(r["scenario"], r["launcher"]): r for r in doc["runs"]}
    nan = runs["nan", "warm"]
    assert nan["value_s"] > 0 and nan["resumed_before_fault"], nan
    assert max(nan["resumed_step"].values()) == nan["fault_step"] - 1, nan  # nothing older than needed
    lost = runs["lostnode", "warm"]
    assert lost["value_s"] > 0 and set(lost["resumed_step"].values()) != {None}, lost
    assert min(lost["resumed_step"].values()) >= min(lost["step_before"].values()) - 2, lost
    assert runs["nan", "torchrun"]["value_s"] > 0 and runs["lostnode", "torchrun"]["value_s"] > 0
    assert [g["pass"] for g in doc["goals"] if "NaN" in g["name"]] == [True]
    assert list(shm_root.iterdir()) == [], "the run left memory tiers behind"
    assert _processes_naming(str(logs)) == [], "the run left launchers or workers running"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_compiled_nan_in_process(shm_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--compile``: the in-process column of a NaN, with its stages; the process stayed."""
    out, logs = tmp_path / "compiled.json", tmp_path / "logs"
    # --shm-dir /dev/shm itself: the node agent's socket path under shm_root would pass 108 bytes
    rc = recovery.main(["--compile", "--scenarios", "nan", "--launchers", "inprocess", "--cap", "60",
                        "--shm-dir", "/dev/shm", "--logs", str(logs), "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    fig = json.loads(out.read_text())["figures"]["nan"]["inprocess"]
    assert fig["median_s"] is not None and fig["median_s"] > 0 and not fig["capped"], printed
    assert all(fig["stages_s"][s] is not None for s in ("detect", "stop", "pg", "load", "first_step")), printed
    assert "load average" in printed
    assert not _processes_naming(str(logs)), "the bench left processes behind"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_compiled_kill_replaces_the_dead_rank_alone(shm_root: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``--compile``, SIGKILL: the in-process column comes from a replacement joining the survivor
    (no process stopped), with the replacement's own stages."""
    out, logs = tmp_path / "compiled.json", tmp_path / "logs"
    rc = recovery.main(["--compile", "--scenarios", "kill", "--launchers", "inprocess", "--cap", "90",
                        "--shm-dir", "/dev/shm", "--logs", str(logs), "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    fig = json.loads(out.read_text())["figures"]["kill"]["inprocess"]
    assert fig["median_s"] is not None and fig["median_s"] > 0 and not fig["capped"], printed
    assert all(fig["replacement_s"][s] is not None for s in ("spawn", "imports", "join", "load", "compile")), printed
    assert "replacement: compile" in printed
    events = [json.loads(x) for p in logs.rglob("events*.jsonl") for x in p.read_text().splitlines()]
    assert [e["kind"] for e in events if e["event"] == "restart"] == ["replace", "replace"], events
    assert not [e for e in events if e["event"] == "stopped"], "the survivor must not be stopped"
    assert not _processes_naming(str(logs)), "the bench left processes behind"
