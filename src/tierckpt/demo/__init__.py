"""``tierckpt demo``: a job under ``tierckpt run`` loses a worker to SIGKILL and recovers by itself.

The driver starts two ``tierckpt run`` agents on 127.0.0.1 (two "nodes", one worker each, gloo,
each node its own memory tier), waits until the job has trained a while and every agent's
standby interpreters are ready (the steady state the README's figure describes), SIGKILLs the
worker under agent 1 and then only watches: the agents detect the crash, stop every worker,
start the next generation, the workers resume from the memory tier and train to the end. It
prints the time until both ranks train again (warm or cold) and each stage of it (detection,
stop, hand-over, process group, load, first step) from the agents' events and the workers'
traces, and checks that both ranks resumed the same step with the parameters saved at that
step, bit for bit.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tierckpt.testing.twonode import free_port, read_jsonl

__all__ = ["run_demo"]


def _start(work: Path, memory: list[str], steps: int) -> list[subprocess.Popen[bytes]]:
    port, rdzv_id = free_port(), f"demo{os.getpid()}"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = []
    for n in (0, 1):
        cmd = [sys.executable, "-m", "tierckpt.cli", "run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=tierckpt",
               f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}", f"--rdzv-conf=is_host={int(n == 0)}",
               "--max-restarts=3", "--monitor-interval=0.1", "--namespace=tierckpt-demo", f"--memory-dir={memory[n]}",
               f"--events={work / f'events_node{n}.jsonl'}", "-m", "tierckpt.demo.resilient",
               "--workdir", str(work), "--steps", str(steps)]
        log = open(work / f"agent{n}.log", "ab")  # noqa: SIM115 - the child owns it
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
    return procs


def run_demo(*, steps: int = 40, workdir: str = "demo-output", memory_dir: str = "/dev/shm/tierckpt") -> int:
    work = Path(workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    os.makedirs(memory_dir, exist_ok=True)
    memory = [tempfile.mkdtemp(prefix=f"demo-node{n}-", dir=memory_dir) for n in (0, 1)]
    kill_at = max(4, steps // 3)
    print(f"tierckpt demo: tierckpt run, 2 nodes x 1 worker (gloo on 127.0.0.1), {steps} steps, a memory "
          f"checkpoint every step;\n  SIGKILL of the worker on node 1 after step {kill_at} once the standbys are ready; "
          f"logs in {work}")
    procs = _start(work, memory, steps)
    try:
        return _watch(work, procs, kill_at)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for m in memory:
            shutil.rmtree(m, ignore_errors=True)  # give the shared memory back


def _last_step(work: Path, rank: int) -> int:
    return max((e["step"] for e in read_jsonl(work / f"trace_rank{rank}.jsonl") if e["event"] == "step"), default=-1)


def _standbys_ready(work: Path) -> bool:
    """Every agent's standby interpreters (one per worker plus a spare) finished their imports."""
    return all(len([e for e in read_jsonl(work / f"events_node{n}.jsonl") if e["event"] == "standby" and "ready" in e])
               >= 2 for n in (0, 1))


def _stages(work: Path, t_kill: float, g: int) -> list[tuple[str, float]]:
    """Seconds after the kill at which the slower node or rank reached each recovery stage."""
    events = [e for n in (0, 1) for e in read_jsonl(work / f"events_node{n}.jsonl")]
    traces = {r: read_jsonl(work / f"trace_rank{r}.jsonl") for r in (0, 1)}

    def last(name: str, rank_events: bool = False) -> float:
        if rank_events:
            return max(min(e["time"] for e in traces[r] if e["event"] == name and e["generation"] == g)
                       for r in (0, 1))
        gen = g - 1 if name in ("fault", "stopped") else g
        return max(e["time"] for e in events if e["event"] == name and e["generation"] == gen)

    return [("detection (fault event)", min(e["time"] for e in events if e["event"] == "fault") - t_kill),
            ("workers stopped on both nodes", last("stopped") - t_kill),
            ("hand-over (restart events)", last("restart") - t_kill),
            ("process group", last("pg", True) - t_kill),
            ("state loaded from memory", last("resumed", True) - t_kill),
            ("first training step", last("step", True) - t_kill)]


def _watch(work: Path, procs: list[subprocess.Popen[bytes]], kill_at: int) -> int:
    deadline = time.monotonic() + 240
    # the steady state: faults are rarer than a standby's imports (a few seconds)
    while _last_step(work, 1) < kill_at or (not _standbys_ready(work) and time.monotonic() < deadline - 180):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            print(f"the job did not reach step {kill_at}; see {work}/agent*.log")
            return 1
        time.sleep(0.02)
    victim = int((work / "pid_rank1").read_text())
    t_kill = time.time()
    os.kill(victim, signal.SIGKILL)
    print(f"  SIGKILL -> worker rank 1 (pid {victim}) after step {_last_step(work, 1)}")
    for p in procs:
        p.wait(timeout=240)
    codes = [p.returncode for p in procs]
    events = [e for n in (0, 1) for e in read_jsonl(work / f"events_node{n}.jsonl")]
    traces = {r: read_jsonl(work / f"trace_rank{r}.jsonl") for r in (0, 1)}
    fault = min((e for e in events if e["event"] == "fault"), key=lambda e: e["time"], default=None)
    restart = max((e for e in events if e["event"] == "restart"), key=lambda e: e["time"], default=None)
    if fault is None or restart is None or codes != [0, 0]:
        print(f"the job did not recover (agent exit codes {codes}); see {work}/agent*.log")
        return 1
    g = restart["generation"]
    resumed = {r: next(e for e in traces[r] if e["event"] == "resumed" and e["generation"] == g) for r in (0, 1)}
    first = max(next(e["time"] for e in traces[r] if e["event"] == "step" and e["generation"] == g) for r in (0, 1))
    step = resumed[0]["step"]
    saved = {r: {e["step"]: e["digest"] for e in traces[r] if e["event"] == "step" and e["generation"] < g}
             for r in (0, 1)}
    same = all(resumed[r]["step"] == step and saved[r].get(step) == resumed[r]["digest"] for r in (0, 1))
    print(f"  detected: {fault['reason']} of rank {fault['rank']} ({fault['detail']}) "
          f"{fault['time'] - t_kill:.2f}s after the kill")
    print(f"  every worker stopped and generation {g} started {restart['time'] - t_kill:.2f}s after the kill")
    print(f"  resumed step {step} from the {', '.join(resumed[0]['tiers'] or [])} tier "
          f"(load {max(r['load_s'] for r in resumed.values()) * 1000:.1f} ms); "
          f"first training step after the restore {first - t_kill:.2f}s after the kill")
    warm = all(next(e for e in traces[r] if e["event"] == "start" and e["generation"] == g)["warm"] for r in (0, 1))
    print(f"  SIGKILL -> both ranks train again: {first - t_kill:.2f}s "
          f"({'warm: standby interpreters took over' if warm else 'cold: no standby was ready'}); stages:")
    prev = 0.0
    for name, at in _stages(work, t_kill, g):
        print(f"    {name:<32} +{at - prev:.2f}s  (at {at:.2f}s)")
        prev = at
    print(f"  both ranks resumed the state saved at step {step}, bit for bit: {same}")
    print(f"  trained to step {_last_step(work, 0)}; agents exited {codes}")
    print("\nrecovered from SIGKILL by itself: " + ("OK" if same else "FAILED"))
    return 0 if same else 1
