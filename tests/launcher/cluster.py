"""A job of several ``tierckpt run`` agents on 127.0.0.1 for the scenario tests.

    job = LocalJob(tmp_path, shm_factory, nnodes=2, train=["--steps", "60"])
    job.start()                                  # one agent per node, each its own memory root
    job.wait_for(lambda: job.last_step(1) >= 10, 60, "rank 1 trains")
    os.kill(job.worker_pid(1), signal.SIGKILL)
    codes = job.wait_exit(120)

Every agent runs in its own session, so ``kill_node`` (SIGKILL to the agent's process
group) takes the agent and its workers, like a machine that is gone. ``close`` kills what is
left, by process group of the agents this object started. No sleep is a check: ``wait_for``
polls a condition until a deadline and fails with what it saw.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tierckpt.launcher.workers.warm import kill_if_standby
from tierckpt.testing.twonode import free_port, read_jsonl

NS = "scn"


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first found through /proc/<pid>/task/*/children)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except FileNotFoundError:
            continue
        for t in tasks:
            try:
                kids = [int(x) for x in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def replica_steps(memory_root: str) -> list[int]:
    """The committed steps of the replicas a node holds (``.replicas/<origin>/<ns>/step_<N>/COMMITTED``).

    The node's retention deletes old steps while this walks: ``os.walk`` skips a directory that
    vanished under it (``pathlib.rglob`` raises ``FileNotFoundError``, seen in CI)."""
    steps = []
    for d, _dirs, files in os.walk(Path(memory_root) / ".replicas"):
        name = os.path.basename(d)
        if "COMMITTED" in files and name.startswith("step_") and name[5:].isdigit():
            steps.append(int(name[5:]))
    return steps


def newest_replica(memory_root: str) -> int | None:
    """The newest committed step of the replicas a node holds, ``None`` when it holds none."""
    return max(replica_steps(memory_root), default=None)


def offenders_job_file(tmp_path: Path, max_avoid: int) -> Path:
    """A job file whose restart policy avoids up to ``max_avoid`` repeat offenders (one hour's window)."""
    path = tmp_path / f"job{max_avoid}.yaml"
    path.write_text(f"""restartPolicy:
  evalPeriodSeconds: 3600
  maxNumRepeatOffendersToAvoid: {max_avoid}
""")
    return path


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[-1][:1] not in ("Z", "X")
    except FileNotFoundError:
        return False


class LocalJob:
    def __init__(self, tmp: Path, shm: Callable[[str], str], *, nnodes: int = 2, train: Sequence[str] = (),
                 run_args: Sequence[str] = (), job_file: Path | None = None, durable: str | None = None,
                 node_timeout: float | None = None, max_restarts: int = 3, slots: int | None = None,
                 nnodes_arg: str | None = None) -> None:
        self.tmp = tmp
        self.work = tmp / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.nnodes = nnodes
        #: agents this job may start (spares and late arrivals beyond ``nnodes``), each its own memory root
        self.slots = nnodes if slots is None else slots
        #: ``--nnodes`` as passed (``MIN:MAX`` for elastic jobs); default ``nnodes``
        self.nnodes_arg = str(nnodes) if nnodes_arg is None else nnodes_arg
        self.port = free_port()
        self.memory = [shm(f"n{n}") for n in range(self.slots)]
        self.train = list(train)
        self.run_args = list(run_args)
        self.job_file = job_file
        self.durable = durable
        #: ``--node-timeout`` when not None; the user's default (10 s) otherwise, as scenarios must run
        self.node_timeout = node_timeout
        self.max_restarts = max_restarts
        self.agents: dict[int, subprocess.Popen[bytes]] = {}
        #: the rendezvous backend (``--rdzv-backend``): c10d, or tierckpt (membership/rdzv.py)
        self.rdzv_backend = os.environ.get("TIERCKPT_TEST_RDZV_BACKEND", "tierckpt")
        self.rdzv_id = f"job{self.port}"
        self.per_node_args: dict[int, list[str]] = {}
        #: the workers' module (``python -m``), given ``--workdir`` and ``train``
        self.module = "tierckpt.demo.resilient"

    def command(self, node: int) -> list[str]:
        cmd = [sys.executable, "-m", "tierckpt.cli", "run", f"--nnodes={self.nnodes_arg}", "--nproc-per-node=1",
               f"--rdzv-backend={self.rdzv_backend}", f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.rdzv_id}",
               f"--rdzv-conf=is_host={int(node == 0)}", f"--max-restarts={self.max_restarts}",
               "--monitor-interval=0.1", f"--namespace={NS}", f"--memory-dir={self.memory[node]}",
               f"--events={self.events_path(node)}", *self.run_args,
               *self.per_node_args.get(node, [])]
        if self.node_timeout is not None:
            cmd.append(f"--node-timeout={self.node_timeout}")
        if self.job_file is not None:
            cmd.append(f"--job={self.job_file}")
        if self.durable is not None:
            cmd.append(f"--durable-url={self.durable}")
        return [*cmd, "-m", self.module, "--workdir", str(self.work), *self.train]

    def events_path(self, node: int) -> Path:
        return self.tmp / f"events{node}.jsonl"

    def start(self, order: Sequence[int] | None = None) -> None:
        """Start every node's agent, in ``order`` (on one host torch ranks the nodes by pid)."""
        for n in (range(self.nnodes) if order is None else order):
            self.start_agent(n)

    def start_agent(self, node: int) -> None:
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        log = open(self.tmp / f"agent{node}.log", "ab")  # noqa: SIM115 - the child owns it
        self.agents[node] = subprocess.Popen(self.command(node), env=env, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        log.close()

    # ---- what happened ----
    def events(self, node: int | None = None) -> list[dict[str, Any]]:
        nodes = range(self.slots) if node is None else [node]
        return [e for n in nodes for e in read_jsonl(self.events_path(n))]

    def trace(self, rank: int) -> list[dict[str, Any]]:
        return read_jsonl(self.work / f"trace_rank{rank}.jsonl")

    def last_step(self, rank: int, generation: int | None = None) -> int:
        steps = [e["step"] for e in self.trace(rank) if e["event"] == "step"
                 and (generation is None or e["generation"] == generation)]
        return max(steps, default=-1)

    def resumed(self, rank: int, generation: int) -> dict[str, Any] | None:
        for e in self.trace(rank):
            if e["event"] == "resumed" and e["generation"] == generation:
                return e
        return None

    def worker_pid(self, rank: int) -> int:
        return int((self.work / f"pid_rank{rank}").read_text())

    def log(self, node: int) -> str:
        return (self.tmp / f"agent{node}.log").read_text(errors="replace")

    # ---- waiting ----
    def wait_for(self, cond: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for: {what}\n{self.report()}")

    def wait_exit(self, timeout: float, nodes: Sequence[int] | None = None) -> dict[int, int]:
        nodes = list(self.agents) if nodes is None else list(nodes)
        self.wait_for(lambda: all(self.agents[n].poll() is not None for n in nodes), timeout, "agents exit")
        return {n: int(self.agents[n].returncode) for n in nodes}

    def report(self) -> str:
        parts = []
        for n in sorted(self.agents):
            tail = "\n".join(self.log(n).splitlines()[-25:]) if (self.tmp / f"agent{n}.log").exists() else ""
            parts.append(f"--- agent {n} (rc {self.agents[n].poll()}) events:\n"
                         + "\n".join(json.dumps(e) for e in self.events(n)) + f"\n--- log tail:\n{tail}")
        return "\n".join(parts)

    def kill_node(self, node: int) -> None:
        """The machine is gone: SIGKILL to the agent and every worker in its session."""
        os.killpg(self.agents[node].pid, signal.SIGKILL)
        self.agents[node].wait(timeout=30)

    def kill_machine(self, node: int) -> None:
        """The machine is gone: the agent and everything it started (workers, standbys, its reaper)
        stop at once (SIGSTOP to all, then SIGKILL to all, so none of them acts on another's death)."""
        agent = self.agents[node].pid
        pids = [agent, *descendants(agent)]
        for pid in pids:
            _signal(pid, signal.SIGSTOP)
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        self.agents[node].wait(timeout=30)

    def group_rank(self, node: int) -> int:
        """The group rank this node's agent held in its newest started/restart event."""
        ev = [e for e in self.events(node) if e["event"] in ("started", "restart")]
        return int(ev[-1]["node"])

    def close(self) -> None:
        for proc in self.agents.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)
        for proc in self.agents.values():  # workers orphaned by an agent killed alone
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        # warm workers orphaned by a killed agent: their command line is the standby's, so by pid
        for rank in range(self.slots):
            for pid in {e["pid"] for e in self.trace(rank)}:
                kill_if_standby(pid)
