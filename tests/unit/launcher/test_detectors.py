"""The node's local detectors as one part (launcher/detect/detectors.py), on real files: beat
files written by the workers' own writer (monitor.py), output files, fake process failures (the
one thing that needs a dying process, which torch's process context reports as an object with
``exitcode``, ``pid`` and ``local_rank``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tierckpt import monitor, workerenv
from tierckpt.launcher.decide.faults import Kind
from tierckpt.launcher.detect.detectors import Detectors
from tierckpt.launcher.detect.heartbeat import HeartbeatPolicy
from tierckpt.launcher.jobspec import LogRule

RESET = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"


@dataclass
class _Failure:  # torch's ProcessFailure: the fields the detectors read
    exitcode: int
    pid: int
    local_rank: int


def _outputs(tmp_path: Path, texts: dict[int, str]) -> tuple[dict[int, str], dict[int, str]]:
    err = {}
    for lr, text in texts.items():
        (tmp_path / f"err{lr}").write_text(text)
        err[lr] = str(tmp_path / f"err{lr}")
    return err, {}


def test_a_crash_of_its_own_is_named_before_a_peers_symptom(tmp_path: Path) -> None:
    outputs = _outputs(tmp_path, {0: f"Traceback ...\n{RESET}\n", 1: "ValueError: a bug of its own\n"})
    fails = {4: _Failure(1, 100, 0), 5: _Failure(3, 101, 1)}
    rec = Detectors.crash(fails, outputs, since=7.0)
    assert (rec.kind, rec.rank, rec.symptom, rec.detail, rec.since) == (Kind.EXITED, 5, None, "exit code 3", 7.0)
    only_symptom = Detectors.crash({4: fails[4]}, outputs, since=7.0)
    assert only_symptom.rank == 4 and only_symptom.symptom == RESET.strip()
    killed = Detectors.crash({4: _Failure(-9, 100, 0)}, outputs, since=None, expired={100: "step"})
    assert killed.kind is Kind.KILLED and killed.symptom is None  # a signal is its own cause
    assert killed.detail == "killed by SIGKILL (torch's file timer 'step' expired)"
    assert killed.evidence == {"exitcode": -9}


def test_beats_make_records_only_for_faults_and_the_beats_are_read_for_claims(tmp_path: Path) -> None:
    det = Detectors(HeartbeatPolicy(), [], str(tmp_path))
    det.arm([0, 1], (), now=0.0)
    writers = {lr: monitor._Writer(str(tmp_path / workerenv.beat_file(lr))) for lr in (0, 1)}
    for step in (1, 2, 3):
        for w in writers.values():
            w.write(step, 0.5)
        assert det.silent(float(step), generation=0, nnodes=1, pids={}, ranks={0: 10, 1: 11}) == []
    assert det.all_beat() and (det.progress(), det.first_step(), det.nan_step()) == (3, 1, None)
    writers[1].write(4, float("nan"))
    (rec,) = det.silent(4.0, generation=0, nnodes=1, pids={}, ranks={0: 10, 1: 11})
    assert (rec.kind, rec.reason, rec.rank, rec.step) == (Kind.NON_FINITE, "NonFiniteLoss", 11, 4)
    assert det.nan_step() == 4 and det.steps() == [(3, False), (4, True)]
    det.rearm(5.0)  # an in-process restart: no beat yet, nothing learned is lost
    assert not det.all_beat() and det.progress() is None and set(det.trackers) == {0, 1}
    assert det.learn() is det.learned


def test_a_log_rule_on_a_workers_output_is_a_record_with_its_rank(tmp_path: Path) -> None:
    rule = LogRule(name="NaNLoss", log_pattern=re.compile(r".*Loss: nan.*"), fault_on_match=True)
    out = tmp_path / "out0"
    out.write_text("")
    det = Detectors(HeartbeatPolicy(), [rule], str(tmp_path))
    det.arm([0], ({0: str(out)},), now=0.0)
    assert det.silent(0.5, generation=0, nnodes=1, pids={}, ranks={0: 3}) == []
    with out.open("a") as f:
        f.write("Batch 3 Loss: nan, Speed: 1\n")
    (rec,) = det.silent(1.0, generation=0, nnodes=1, pids={}, ranks={0: 3})
    assert (rec.kind, rec.reason, rec.rank) == (Kind.LOG_RULE, "LogFault_NaNLoss", 3)
    det.close()


def test_calibration_is_reported_once_per_generation(tmp_path: Path) -> None:
    det = Detectors(HeartbeatPolicy(), [], str(tmp_path))
    det.arm([0], (), now=0.0)
    w = monitor._Writer(str(tmp_path / workerenv.beat_file(0)))
    got = []
    for i in range(1, 12):
        w.write(i, 1.0)
        det.silent(i * 0.1, generation=0, nnodes=1, pids={}, ranks={0: 0})
        got.append(det.calibration())
    fields = [g for g in got if g is not None]
    assert len(fields) == 1 and fields[0]["heartbeat_timeout_s"] == 5.0 and fields[0]["hang_ceiling_s"] == 300.0
    det.arm([0], (), now=2.0)  # a new generation reports again once calibrated
    assert det.calibration() is None
