"""A replacement process joins the survivors' in-process generation (``tierckpt.resilient``), no launcher.

This test plays the agent: it hosts the in-process store (``TIERCKPT_INPROC_STORE``), starts 2
gloo ranks of the demo job under the wrapper, SIGKILLs rank 1 mid-training and starts one
replacement rank 1 with ``TIERCKPT_INPROC_JOIN=Crash``. Rank 0 keeps its process; both ranks
report generation 1 with the reason ``Crash`` (not rank 0's connection error), roll back to the
same saved step bit for bit, and train to the end.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.slow

STEPS = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(tmp: Path, shm: str, rank: int, master: int, store: str, **extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "TIERCKPT_MEMORY_DIR": shm,
           "TIERCKPT_NAMESPACE": "join-test", "TIERCKPT_MONITOR_DIR": str(tmp / "mon"), "OMP_NUM_THREADS": "1",
           "TIERCKPT_INPROC_STORE": store, **extra}
    cmd = [sys.executable, "-m", "tierckpt.demo.resilient", "--workdir", str(tmp / "work"), "--inprocess",
           "--steps", str(STEPS), "--step-time", "0.1"]
    with open(tmp / f"out{rank}-{len(list(tmp.glob(f'out{rank}-*')))}.log", "wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def _trace(tmp: Path, rank: int) -> list[dict[str, Any]]:
    path = tmp / "work" / f"trace_rank{rank}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _logs(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("out*.log")))


@pytest.mark.timeout(240)
def test_a_replacement_joins_the_survivor_in_process(tmp_path: Path, shm: Any) -> None:
    (tmp_path / "mon").mkdir()
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60),  # type: ignore[attr-defined]
                           wait_for_workers=False)
    store = f"127.0.0.1:{server.port}/7"
    memory, master = shm(), _free_port()
    procs = [_spawn(tmp_path, memory, r, master, store) for r in (0, 1)]
    try:
        deadline = time.monotonic() + 150
        while max((e["step"] for e in _trace(tmp_path, 1) if e["event"] == "step"), default=-1) < 6 or \
                not [e for e in _trace(tmp_path, 0) if e["event"] == "step" and e["step"] >= 6]:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), _logs(tmp_path)
            time.sleep(0.05)
        survivor, victim = procs[0].pid, procs[1].pid
        os.kill(victim, signal.SIGKILL)
        procs[1].wait(10)
        procs.append(_spawn(tmp_path, memory, 1, master, store, TIERCKPT_INPROC_JOIN="Crash"))
        for p in (procs[0], procs[2]):
            assert p.wait(150) == 0, _logs(tmp_path)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert {e["pid"] for e in _trace(tmp_path, 0)} == {survivor}, "the survivor keeps its process"
    assert {e["pid"] for e in _trace(tmp_path, 1)} == {victim, procs[2].pid}
    resumed = {r: [e for e in _trace(tmp_path, r) if e["event"] == "resumed" and e["inproc"] == 1][0] for r in (0, 1)}
    assert resumed[0]["step"] == resumed[1]["step"] is not None
    for r in (0, 1):
        pg = [e for e in _trace(tmp_path, r) if e["event"] == "pg" and e["inproc"] == 1]
        assert pg and pg[0]["reason"] == "Crash", pg
        saved = [e for e in _trace(tmp_path, r) if e["event"] == "step" and e["inproc"] == 0
                 and e["step"] == resumed[r]["step"]]
        assert saved and saved[-1]["digest"] == resumed[r]["digest"], "rollback must be bitwise"
        assert _trace(tmp_path, r)[-1]["event"] == "done"
    finals = {r: [e["digest"] for e in _trace(tmp_path, r) if e["event"] == "step" and e["step"] == STEPS][-1]
              for r in (0, 1)}
    assert finals[0] == finals[1], "both ranks end with the same parameters"
    reports = [json.loads(x) for x in (tmp_path / "mon" / "inproc_1.jsonl").read_text().splitlines()]
    joined = [r for r in reports if r["event"] == "restart" and r.get("joined")]
    assert joined and joined[0]["k"] == 1 and joined[0]["pid"] == procs[2].pid
    assert all(r.get("store") == "agent" for r in reports if r["event"] == "ready")
    keys = [f"tierckpt/inproc/7/{k}" for k in ("current", "0/fault", "0/crash")]
    assert server.check(keys) and server.get("tierckpt/inproc/7/0/crash") == b"Crash"
