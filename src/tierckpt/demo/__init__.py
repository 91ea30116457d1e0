"""``tierckpt demo``: train on 2 CPU ranks, SIGKILL one mid-run, restart, resume from memory.

The driver starts the job with torchrun (gloo on 127.0.0.1), waits until rank 1 has saved
about half the steps, kills it with SIGKILL, lets torchrun tear the job down, starts it
again and reads each rank's result: which step and tier it resumed from, whether the
resumed state equals the state saved at that step, and how long saves blocked.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["run_demo"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(steps: int, work: Path, memory_dir: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
        "--master-addr=127.0.0.1", f"--master-port={_free_port()}", "--max-restarts=0",
        "-m", "tierckpt.demo.train", "--steps", str(steps), "--workdir", str(work), "--memory-dir", memory_dir,
    ]
    log = open(work / "torchrun.log", "ab")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def run_demo(*, steps: int = 24, workdir: str = "demo-output", memory_dir: str = "/dev/shm/tierckpt") -> int:
    from tierckpt.demo.train import NAMESPACE

    work = Path(workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(Path(memory_dir) / NAMESPACE, ignore_errors=True)
    work.mkdir(parents=True)
    kill_at = max(2, steps // 2)
    print(f"tierckpt demo: 2 ranks (torchrun, gloo), {steps} steps, memory every step, durable every 5")
    print(f"  memory tier  {memory_dir}/{NAMESPACE}\n  durable tier {work / 'durable'}")

    job = _launch(steps, work, memory_dir)
    progress, pid_file = work / "pids" / "progress_1", work / "pids" / "rank_1"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and job.poll() is None:
        if progress.exists() and progress.read_text().strip() and int(progress.read_text()) >= kill_at:
            break
        time.sleep(0.02)
    if job.poll() is not None:
        print(f"first run ended early (exit {job.returncode}); see {work / 'torchrun.log'}")
        return 1
    victim = int(pid_file.read_text())
    os.kill(victim, signal.SIGKILL)
    killed_after = progress.read_text()
    print(f"  run 1: SIGKILL sent to rank 1 (pid {victim}) after it saved step {killed_after}")
    job.wait(timeout=120)
    print(f"  run 1: torchrun exited with {job.returncode} (the job died)")

    t0 = time.monotonic()
    job = _launch(steps, work, memory_dir)
    rc = job.wait(timeout=600)
    print(f"  run 2: restarted, exited with {rc} after {time.monotonic() - t0:.1f}s")
    if rc != 0:
        print(f"restart failed; see {work / 'torchrun.log'}")
        return 1
    results = [json.loads((work / f"result_rank_{r}.json").read_text()) for r in (0, 1)]
    ok = all(r["resumed_from"] is not None and r["state_matches"] for r in results)
    print("\nsummary")
    for r in results:
        print(
            f"  rank {r['rank']}: resumed from step {r['resumed_from']} ({', '.join(r['load_tiers'])} tier), "
            f"load {r['load_s'] * 1000:.1f} ms, state equals the saved one: {r['state_matches']}, "
            f"median save blocking {r['median_blocking_s'] * 1000:.1f} ms over {len(r['blocking_s'])} saves, "
            f"trained to step {r['final_step']}"
        )
    print("\nresumed after SIGKILL: " + ("OK" if ok else "FAILED"))
    shutil.rmtree(Path(memory_dir) / NAMESPACE, ignore_errors=True)  # give the shared memory back
    print(f"(removed the demo's memory tier; its durable copies stay in {work / 'durable'})")
    return 0 if ok else 1
