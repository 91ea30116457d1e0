"""``tierckpt run`` on namespaced hosts: one launcher per host, the rendezvous on host 0's address.

    job = HostJob(cluster, tmp_path, train=["--steps", "80"], run_args=["--replicas", "1"])
    job.start([h0, h1])                       # node i's tierckpt run on hosts[i]
    job.wait_for(lambda: job.last_step(1) >= 10, 90, "rank 1 trains")
    h1.kill()                                 # the host, its workers, its /dev/shm and its IP
    job.start_node(cluster.add_host(), 1)     # a replacement host (new name, new IP) as node 1
    codes = job.wait_exit(150)

    gen, joined = spare_took_rank(job, h1, h2)   # a spare on h2 took h1's rank 1; both ranks train
    got = job.resumed(1, gen)                     # bit for bit what rank 1 saved at that step:
    assert got["digest"] == saved_digests(job, 1, gen)[got["step"]]

The workers' traces (``trace_rank<r>.jsonl``) and every launcher's events and log are on the
machine's disk (``workdir``), shared by all hosts like a cluster's shared filesystem; the memory
tier is each host's own ``/dev/shm/tierckpt``. Every process is a host's: ``Cluster.close`` (the
fixture) ends them all, so a job needs no clean-up of its own.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.cluster.hosts import Cluster, Host, children
from tierckpt.testing.twonode import read_jsonl

NS = "scn"
RDZV_PORT = 29400
AGENT_PORT = 7601
#: the memory tier every host's agent uses (each host has its own /dev/shm)
MEMORY = "/dev/shm/tierckpt"


def newest_replica(host: Host, ns: str = "*") -> int:
    """The newest committed step of ``ns``'s replicas in ``host``'s memory tier, ``-1`` when it holds none
    (``find`` tolerates the steps that retention deletes while it walks)."""
    found = host.run(["sh", "-c", f"find {MEMORY}/.replicas -path '*/{ns}/step_*/COMMITTED'"], check=False).stdout
    return max((int(m) for m in re.findall(r"step_(\d+)/COMMITTED", found)), default=-1)


def host_env(**extra: str) -> dict[str, str]:
    """The environment for Python on a host: this checkout first on the path, gloo on ``eth0``."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    path = os.pathsep.join([src, str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path.rstrip(os.pathsep), GLOO_SOCKET_IFNAME="eth0",
                OMP_NUM_THREADS="1", **extra)


class HostJob:
    def __init__(self, cluster: Cluster, tmp: Path, *, nnodes: int | str = 2, train: Sequence[str] = (),
                 run_args: Sequence[str] = (), durable: str | None = None, node_timeout: float | None = None,
                 max_restarts: int = 3) -> None:
        self.cluster = cluster
        self.tmp = tmp
        self.work = tmp / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.nnodes = nnodes  # ``--nnodes`` as passed: N, or MIN:MAX (elastic, hot spares)
        self.train = list(train)
        self.run_args = list(run_args)
        self.durable = durable
        #: ``--node-timeout`` when not None; the user's default (10 s) otherwise, as scenarios must run
        self.node_timeout = node_timeout
        self.max_restarts = max_restarts
        #: the rendezvous backend (``--rdzv-backend``): c10d, or tierckpt (membership/rdzv.py)
        self.rdzv_backend = os.environ.get("TIERCKPT_TEST_RDZV_BACKEND", "tierckpt")
        self.rdzv_id = f"job{os.getpid()}"
        self.secret = secrets.token_hex(32)
        self.head: Host | None = None
        self.launchers: dict[str, subprocess.Popen[bytes]] = {}  # by host name
        self.nodes: dict[str, int] = {}  # host name -> node slot

    def command(self, host: Host, node: int) -> list[str]:
        assert self.head is not None
        cmd = [sys.executable, "-m", "tierckpt.cli", "run", f"--nnodes={self.nnodes}", "--nproc-per-node=1",
               f"--rdzv-backend={self.rdzv_backend}", f"--rdzv-endpoint={self.head.ip}:{RDZV_PORT}", f"--rdzv-id={self.rdzv_id}",
               f"--rdzv-conf=is_host={int(host is self.head)}", f"--max-restarts={self.max_restarts}",
               "--monitor-interval=0.1", f"--namespace={NS}", "--memory-dir=/dev/shm/tierckpt",
               f"--events={self.events_path(host.name)}", *self.run_args]
        if self.durable is not None:
            cmd.append(f"--durable-url={self.durable}")
        if self.node_timeout is not None:
            cmd.append(f"--node-timeout={self.node_timeout}")
        return [*cmd, "-m", "tierckpt.demo.resilient", "--workdir", str(self.work), *self.train]

    def state(self, host: Host) -> dict[str, Any]:
        """The restart-state file ``host``'s launcher keeps beside its memory tier (launcher/supervisor/runstate.py)."""
        path = f"/dev/shm/tierckpt/.tierckpt-run/{self.rdzv_id}.json"
        return dict(json.loads(host.run(["cat", path]).stdout))

    def events_path(self, name: str) -> Path:
        return self.tmp / f"events-{name}.jsonl"

    def start(self, hosts: Sequence[Host]) -> None:
        self.head = hosts[0]
        for node, host in enumerate(hosts):
            self.start_node(host, node)

    def start_node(self, host: Host, node: int, **env_extra: str) -> None:
        log = open(self.tmp / f"launcher-{host.name}.log", "ab")  # noqa: SIM115 - the child owns it
        env = host_env(TIERCKPT_AGENT_SECRET=self.secret, **env_extra)
        self.launchers[host.name] = host.popen(self.command(host, node), env=env, stdout=log,
                                               stderr=subprocess.STDOUT)
        self.nodes[host.name] = node
        log.close()

    # ---- what happened ----
    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        names = list(self.launchers) if name is None else [name]
        return [e for n in names for e in read_jsonl(self.events_path(n))]

    def trace(self, rank: int) -> list[dict[str, Any]]:
        return read_jsonl(self.work / f"trace_rank{rank}.jsonl")

    def last_step(self, rank: int, generation: int | None = None) -> int:
        steps = [e["step"] for e in self.trace(rank) if e["event"] == "step"
                 and (generation is None or e["generation"] == generation)]
        return max(steps, default=-1)

    def resumed(self, rank: int, generation: int) -> dict[str, Any] | None:
        return next((e for e in self.trace(rank) if e["event"] == "resumed" and e["generation"] == generation), None)

    def resumed_last(self, ranks: Sequence[int]) -> tuple[int, dict[int, dict[str, Any]]]:
        """The newest generation (rank 0's) and every rank's ``resumed`` event in it; fails, with
        the report, when a rank did not resume from a step there."""
        gen = max(e["generation"] for e in self.trace(0))
        got = {r: self.resumed(r, gen) for r in ranks}
        assert all(v is not None and v["step"] is not None for v in got.values()), (got, self.report())
        return gen, {r: v for r, v in got.items() if v is not None}

    def form(self, hosts: Sequence[Host], timeout: float = 180) -> None:
        """``start`` and wait until every launcher started its workers (the first round formed)."""
        self.start(hosts)
        self.wait_for(lambda: all(any(e["event"] == "started" for e in self.events(h.name)) for h in hosts),
                      timeout, " and ".join(h.name for h in hosts) + " form the job")

    def launcher_pid(self, name: str) -> int:
        """The PID of ``name``'s ``tierckpt run`` process as its host sees it (``nsenter --pid``
        forks: the launcher is the one child of the ``nsenter`` this job started)."""
        kids = children(self.launchers[name].pid)
        assert len(kids) == 1, f"{name}: expected one process under nsenter {self.launchers[name].pid}, got {kids}"
        assert b"tierckpt.cli" in Path(f"/proc/{kids[0]}/cmdline").read_bytes(), kids
        nspid = next(line for line in Path(f"/proc/{kids[0]}/status").read_text().splitlines()
                     if line.startswith("NSpid:"))
        return int(nspid.split()[-1])  # the innermost namespace's: the host's own

    def freeze_launcher(self, host: Host) -> int:
        """SIGSTOP to ``host``'s ``tierckpt run`` alone (its workers, standbys and agent threads'
        other processes go on), sent on the host by the launcher's PID there; that PID."""
        pid = self.launcher_pid(host.name)
        host.run(["kill", "-STOP", str(pid)])
        return pid

    def thaw_launcher(self, host: Host, pid: int) -> None:
        """SIGCONT to the launcher ``freeze_launcher`` stopped, and to the ``nsenter`` above it:
        util-linux's nsenter waits for its child with ``WUNTRACED`` and stops itself when the child
        stops (job control), and only a SIGCONT of its own wakes it; left stopped, it never reaps
        the launcher and the job sees the launcher run forever (seen: ``wait_exit`` timed out with
        the launcher's ``exit`` event written)."""
        host.run(["kill", "-CONT", str(pid)])
        os.kill(self.launchers[host.name].pid, signal.SIGCONT)

    def worker_pid(self, rank: int) -> int:
        """The worker's PID as its host sees it (signal it with ``host.run(["kill", ...])``)."""
        return int((self.work / f"pid_rank{rank}").read_text())

    def report(self) -> str:
        parts = []
        for name, proc in self.launchers.items():
            log = self.tmp / f"launcher-{name}.log"
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:]) if log.exists() else ""
            parts.append(f"--- {name} (node {self.nodes[name]}, rc {proc.poll()}) events:\n"
                         + "\n".join(json.dumps(e) for e in self.events(name)) + f"\n--- log tail:\n{tail}")
        return "\n".join(parts)

    # ---- waiting ----
    def wait_for(self, cond: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for: {what}\n{self.report()}")

    def wait_exit(self, timeout: float, names: Sequence[str]) -> dict[str, int]:
        self.wait_for(lambda: all(self.launchers[n].poll() is not None for n in names), timeout, "launchers exit")
        return {n: int(self.launchers[n].returncode) for n in names}


# ---- what a scenario checks, shared by the tests ----
def first_step_after(job: HostJob, rank: int, generation: int) -> float | None:
    """When ``rank`` first stepped in ``generation`` or later (None: not yet)."""
    times = [e["time"] for e in job.trace(rank) if e["event"] == "step" and e["generation"] >= generation]
    return min(times) if times else None


def saved_digests(job: HostJob, rank: int, before: int) -> dict[int, str]:
    """step -> parameter digest that ``rank`` recorded in generations below ``before``."""
    return {e["step"]: e["digest"] for e in job.trace(rank) if e["event"] == "step" and e["generation"] < before}


def spare_took_rank(job: HostJob, left: Host, spare: Host, rank: int = 1, ranks: Sequence[int] = (0, 1),
                    timeout: float = 120) -> tuple[int, dict[str, Any]]:
    """Wait until the spare on ``spare`` joined as node ``rank`` in ``left``'s place and every rank
    of ``ranks`` trains in the generation it joined; that generation and the spare's ``joined`` event."""
    joined = job.wait_for(lambda: next((e for e in job.events(spare.name) if e["event"] == "spare"
                                        and e["state"] == "joined"), None), timeout, f"the spare on {spare.name} joins")
    assert joined["node"] == rank and joined["replaced"] == f"{left.name}:{MEMORY}", joined
    gen = int(joined["generation"])
    for r in ranks:
        job.wait_for(lambda r=r: first_step_after(job, r, gen), timeout, f"rank {r} trains in generation {gen}")
    return gen, joined


#: a lost host is named within this of its link going down (issue 25), at the default --node-timeout
LOST_HOST_DETECT_S = 3.0


def assert_lost_host_blamed(job: HostJob, survivor: Host, fault: dict[str, Any], t_kill: float, *, node: int) -> None:
    """The survivor's first fault is ``LostNode`` naming ``node`` within ``LOST_HOST_DETECT_S`` of the
    kill, decided by the diagnosis, and no fault of the survivor names the survivor's own node."""
    assert fault["reason"] == "LostNode" and fault["node"] == node and fault["rank"] is None, job.report()
    assert fault["time"] - t_kill <= LOST_HOST_DETECT_S, (fault["time"] - t_kill, fault)
    assert fault["diagnosis"]["cause"] == "lost_node" and fault["lost"] == [node], fault
    mine = job.nodes[survivor.name]
    assert not [e for e in job.events(survivor.name) if e["event"] == "fault" and e.get("node") == mine], job.report()
