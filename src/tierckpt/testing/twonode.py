"""Two launcher agents x one worker on 127.0.0.1: the job the recovery benchmark times.

    job = TwoNodeJob("tierckpt", root, shm_parent, steps=600, step_time=0.1)
    job.start()                                   # 2 agents, each in its own session
    job.wait_for(lambda: job.min_step() >= 10, 120, "both ranks reach step 10")
    rank, pid = job.victim(node=1)                # the worker under agent 1
    ...
    job.close()                                   # SIGKILL: agents' groups, then every worker

The launcher is ``tierckpt run`` (its ``--namespace``/``--memory-dir``/``--events``) or plain
torchrun (``python -m torch.distributed.run``, the same torchrun arguments, the tier settings
in the environment and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, without which a restart can
hang, pytorch#135712). Each node has its own memory tier under ``shm_parent``. Workers
started by torchrun live in sessions of their own, so ``close`` also kills, by pid, every
process whose command line names this job's unique work directory.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["LAUNCHERS", "JobTimeout", "TwoNodeJob", "free_port", "read_jsonl"]

LAUNCHERS = ("tierckpt", "torchrun")
RANKS = (0, 1)
_NS = "bench-recovery"
T = TypeVar("T")


class JobTimeout(RuntimeError):
    """A condition the driver waited for did not come true in time."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of ``path`` (none if it does not exist yet)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def _descendants(root: int) -> list[int]:
    """Live descendants of ``root`` (an agent's workers, standbys and hosted node agent, whatever
    session they started)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _ppid(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


class TwoNodeJob:
    """One job of ``tierckpt.demo.resilient`` under two agents of ``launcher``."""

    def __init__(self, launcher: str, root: Path, shm_parent: Path, *, steps: int, step_time: float) -> None:
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
        self.launcher = launcher
        self.root = root
        self.work = root / "work"
        self.work.mkdir(parents=True)
        self.memory = [shm_parent / f"{root.name}-node{n}" for n in (0, 1)]
        for m in self.memory:
            m.mkdir(parents=True)
        self.steps, self.step_time = steps, step_time
        self.port = free_port()
        self.agents: list[subprocess.Popen[bytes]] = []
        self.extra: list[str] = []  # more arguments for the training script (fault injection)
        self.lost: list[subprocess.Popen[bytes]] = []  # agents replaced by ``relaunch`` (already killed)

    # ---- starting ----
    def command(self, node: int) -> list[str]:
        backend = "c10d" if self.launcher == "torchrun" else "tierckpt"  # each launcher's own default
        rdzv = ["--nnodes=2", "--nproc-per-node=1", f"--rdzv-backend={backend}", f"--rdzv-endpoint=127.0.0.1:{self.port}",
                f"--rdzv-id=bench{self.port}", f"--rdzv-conf=is_host={int(node == 0)}", "--max-restarts=3",
                "--monitor-interval=0.1"]
        train = ["-m", "tierckpt.demo.resilient", "--workdir", str(self.work), "--steps", str(self.steps),
                 "--step-time", str(self.step_time), *self.extra]
        if self.launcher == "torchrun":
            return [sys.executable, "-m", "torch.distributed.run", *rdzv, *train]
        return [sys.executable, "-m", "tierckpt.cli", "run", *rdzv, f"--namespace={_NS}",
                f"--memory-dir={self.memory[node]}", f"--events={self.events_path(node)}", *train]

    def env(self, node: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCKPT_")}
        env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        if self.launcher == "torchrun":
            env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", TIERCKPT_NAMESPACE=_NS,
                       TIERCKPT_MEMORY_DIR=str(self.memory[node]))
        return env

    def start(self) -> None:
        for node in (0, 1):
            self.agents.append(self._spawn(node))

    def _spawn(self, node: int) -> subprocess.Popen[bytes]:
        with open(self.root / f"agent{node}.log", "ab") as log:
            return subprocess.Popen(self.command(node), env=self.env(node), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def lose_node(self, node: int) -> float:
        """A lost host: SIGKILL agent ``node`` and all its descendants (workers, standbys, hosted node
        agent) at once and wipe its memory tier; returns the time of the kill. ``relaunch`` starts
        the replacement."""
        victim = self.agents[node]
        pids = _descendants(victim.pid)
        t_kill = time.time()
        for pid in [victim.pid, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        victim.wait(timeout=30)
        self.lost.append(victim)
        self.wipe_memory(node)
        return t_kill

    def wipe_memory(self, node: int) -> None:
        """Empty node ``node``'s memory tier (its directory stays)."""
        for child in self.memory[node].iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)

    def alive(self, pid: int) -> bool:
        """``pid`` is running (not gone, not a zombie)."""
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    def relaunch(self, node: int) -> None:
        """Start a replacement agent for ``node`` (same arguments, the wiped memory tier)."""
        self.agents[node] = self._spawn(node)

    # ---- what happened ----
    def events_path(self, node: int) -> Path:
        return self.root / f"events{node}.jsonl"

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        evs = [e for n in (0, 1) for e in read_jsonl(self.events_path(n))]
        return [e for e in evs if name is None or e.get("event") == name]

    def trace(self, rank: int) -> list[dict[str, Any]]:
        return read_jsonl(self.work / f"trace_rank{rank}.jsonl")

    def min_step(self) -> int:
        return min(max((e["step"] for e in self.trace(r) if e["event"] == "step"), default=-1) for r in RANKS)

    def pids(self) -> set[int]:
        return {int(e["pid"]) for r in RANKS for e in self.trace(r)}

    def first_after(self, event: str, old_pids: set[int]) -> dict[int, dict[str, Any]] | None:
        """Per rank, the first ``event`` traced by a worker not in ``old_pids``; None until every rank has one."""
        found = {}
        for r in RANKS:
            new = [e for e in self.trace(r) if e["event"] == event and e["pid"] not in old_pids]
            if not new:
                return None
            found[r] = new[0]
        return found

    def victim(self, node: int) -> tuple[int, int]:
        """(rank, pid) of the worker running under agent ``node`` (its child or a descendant)."""
        agent = self.agents[node].pid
        for r in RANKS:
            pid = int((self.work / f"pid_rank{r}").read_text())
            parent: int | None = pid
            for _ in range(4):
                parent = _ppid(parent) if parent is not None else None
                if parent == agent:
                    return r, pid
        raise JobTimeout(f"no worker of agent {node} (pid {agent}) found; see {self.root}/agent{node}.log")

    def exited(self) -> bool:
        return any(p.poll() is not None for p in self.agents)

    def wait_for(self, cond: Callable[[], T | None], timeout: float, what: str) -> T:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            time.sleep(0.02)
        raise JobTimeout(f"{self.launcher}: timed out after {timeout:g}s waiting for {what}; logs in {self.root}")

    # ---- stopping ----
    def close(self) -> None:
        """SIGKILL every agent's process group, then every process naming this job's work directory."""
        for p in self.agents:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(timeout=30)
        for pid in self._stragglers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while self._stragglers() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _stragglers(self) -> list[int]:
        """Live processes whose command line names ``self.work`` (unique to this job)."""
        mark = str(self.work).encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:  # gone meanwhile, or not ours to read
                continue
        return found
