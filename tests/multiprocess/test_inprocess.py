"""In-process restarts on 2 real gloo ranks (the demo job under ``tierckpt.resilient``).

Each fault kind: an exception in one rank, a non-finite loss, a hang in an all-reduce (rank 1
never enters it; this test plays the launcher and writes the restart request). After the
fault both processes must be the same (pid), resume from their memory tier bit for bit
(the digest of the resumed model equals the one traced at the saved step), train to the end,
and report the restart (``inproc_<local rank>.jsonl``, what ``tierckpt run`` turns into a
``restart`` event of kind ``inprocess``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

STEPS, FAULT_STEP = 14, 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(tmp: Path, shm: str, fault: str) -> list[subprocess.Popen[bytes]]:
    port = _free_port()
    (tmp / "mon").mkdir()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TIERCKPT_MEMORY_DIR": shm, "TIERCKPT_NAMESPACE": "inproc-test",
               "TIERCKPT_MONITOR_DIR": str(tmp / "mon"), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-X", "faulthandler", "-m", "tierckpt.demo.resilient", "--workdir", str(tmp / "work"), "--inprocess",
               "--steps", str(STEPS), "--step-time", "0.05", "--fault", fault, "--fault-step", str(FAULT_STEP),
               "--fault-rank", "1"]
        with open(tmp / f"out{rank}.log", "wb") as out:
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs


def _wait(procs: list[subprocess.Popen[bytes]], tmp: Path, timeout: float = 150.0) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            code = p.wait(max(1.0, deadline - time.monotonic()))
            assert code == 0, f"a rank exited with {code}\n{_logs(tmp)}"
    finally:
        for p in procs:  # only the processes this test started
            if p.poll() is None:
                p.kill()
                p.wait()


def _logs(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("out*.log")))


def _trace(tmp: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp / "work" / f"trace_rank{rank}.jsonl").read_text().splitlines()]


def _check(tmp: Path, reason: str, culprit: int | None = 1) -> None:
    for rank in (0, 1):
        tr = _trace(tmp, rank)
        assert len({e["pid"] for e in tr}) == 1, "the process must survive the fault"
        resumed = [e for e in tr if e["event"] == "resumed"]
        assert [e["inproc"] for e in resumed] == [0, 1]
        back = resumed[1]
        assert back["step"] is not None and back["step"] < FAULT_STEP + 2
        saved = [e for e in tr if e["event"] == "step" and e["inproc"] == 0 and e["step"] == back["step"]]
        assert saved and saved[-1]["digest"] == back["digest"], "rollback must be bitwise"
        steps = [e["step"] for e in tr if e["event"] == "step" and e["inproc"] == 1]
        assert steps == list(range(back["step"] + 1, STEPS + 1)), "training must continue to the end"
        assert tr[-1]["event"] == "done"
        reports = [json.loads(x) for x in (tmp / "mon" / f"inproc_{rank}.jsonl").read_text().splitlines()]
        restarts = [r for r in reports if r["event"] == "restart"]
        assert len(restarts) == 1 and restarts[0]["k"] == 1 and reason in restarts[0]["reason"], restarts
        if culprit is not None:  # both ranks name the rank whose fault it was, not themselves
            assert restarts[0]["fault_rank"] == culprit, restarts


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("fault", "reason"), [("raise", "RuntimeError"), ("nan", "NonFiniteLoss")])
def test_fault_in_one_rank_restarts_in_process(tmp_path: Path, shm: Any, fault: str, reason: str) -> None:
    procs = _start(tmp_path, shm(), fault)
    _wait(procs, tmp_path)
    _check(tmp_path, reason)


@pytest.mark.timeout(200)
def test_hang_in_all_reduce_restarts_in_process(tmp_path: Path, shm: Any) -> None:
    procs = _start(tmp_path, shm(), "hang")
    deadline = time.monotonic() + 150
    while b"blocking forever" not in (tmp_path / "out1.log").read_bytes():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), _logs(tmp_path)
        time.sleep(0.1)
    time.sleep(1.0)  # rank 0 is now blocked in its all-reduce
    (tmp_path / "mon" / "inproc_request").write_text("1")  # what tierckpt run writes on a hang
    _wait(procs, tmp_path)
    _check(tmp_path, "launcher request", culprit=None)  # the launcher asked: it names the culprit
