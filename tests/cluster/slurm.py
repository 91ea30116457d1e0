"""A real Slurm on the namespaced hosts: ``munged`` + ``slurmctld`` on host 0, ``slurmd`` on each.

    slurm = Slurm(cluster, hosts)        # writes munge.key, slurm.conf (NodeAddr = each host's IP)
    slurm.start()                        # munged, slurmctld (host 0), one slurmd per host; waits idle
    job = slurm.sbatch(["--nodes=2", script, ...], env)   # real sbatch on host 0 → job id
    slurm.wait_state(job, "RUNNING")
    slurm.scontrol("show", "job", job)
    slurm.close()                        # nothing: the daemons are the hosts' processes (Cluster.close)

Debian's ``slurm-wlm`` 22.05 and ``munge``: ``SlurmUser=root``, ``auth/munge`` with a key made
for the run (one ``munged`` on host 0; its socket is a path on the shared disk, which every
host's mount namespace sees, as a cluster's hosts each see their own), ``proctrack/linuxproc``,
``task/none``, no cgroups, no accounting, ``select/linear`` (whole nodes), ``ReturnToService=2``
(a host that comes back is usable again) and short timeouts so a lost host is noticed in
seconds; ``cred_expire=10`` because a requeued job waits that long before it may start again
(Slurm's default: 120 s); ``sched_interval=5`` because a requeued job that may start waits
for the next full scheduling pass (Slurm's default: every 60 s; most of a requeue's cost in
these tests before). Every path (state, spool, logs, pid files, the socket) is in one directory made for the
run; the daemons run in the foreground on their hosts, so killing a host kills its ``slurmd``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.cluster.hosts import Cluster, Host, wait_for

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue")


def unavailable() -> str | None:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return (f"Slurm/munge not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge "
                "(make test and make test-slow do it when root)")
    return None


class Slurm:
    def __init__(self, cluster: Cluster, hosts: Sequence[Host], *, slurmd_timeout: int = 6) -> None:
        self.cluster = cluster
        self.hosts = list(hosts)
        self.head = self.hosts[0]
        # short: a unix socket path must fit in 108 bytes
        self.dir = Path(tempfile.mkdtemp(prefix="tck-slurm-", dir="/tmp"))
        self.conf = self.dir / "slurm.conf"
        self.socket = self.dir / "munge.socket"
        self.slurmd_timeout = slurmd_timeout
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # ---- set-up ----
    def write_config(self) -> None:
        d = self.dir
        for sub in ("ctld", "munge", *(f"spool-{h.name}" for h in self.hosts)):
            (d / sub).mkdir(mode=0o700, exist_ok=True)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.ip} CPUs=1 State=UNKNOWN" for h in self.hosts)
        names = ",".join(h.name for h in self.hosts)
        self.conf.write_text(f"""ClusterName=tck
SlurmctldHost={self.head.name}({self.head.ip})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={d}/ctld
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/linear
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=5
MpiDefault=none
ReturnToService=2
SlurmdTimeout={self.slurmd_timeout}
SlurmctldTimeout=10
MessageTimeout=5
KillWait=5
InactiveLimit=0
MinJobAge=600
JobRequeue=1
SlurmdParameters=config_overrides
{nodes}
PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP
""")

    def start(self) -> None:
        """munged and slurmctld on host 0, then a slurmd per host; returns once every node is idle."""
        self.write_config()
        d = self.dir
        self._daemon(self.head, "munged", ["munged", "--foreground", "--force", f"--socket={self.socket}",
                                           f"--key-file={d}/munge/munge.key", f"--pid-file={d}/munge/munged.pid",
                                           f"--log-file={d}/munge/munged.log", f"--seed-file={d}/munge/seed"])
        wait_for(lambda: self.socket.exists(), 30, "munged's socket", lambda: self._log("munged.out"))
        self._daemon(self.head, "slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        wait_for(lambda: self.scontrol("ping", check=False).returncode == 0, 60, "slurmctld answers",
                 lambda: self._log("slurmctld.log"))
        for host in self.hosts:
            self.start_slurmd(host)
        wait_for(lambda: self.idle() >= set(h.name for h in self.hosts), 90, "every node idle",
                 lambda: self.run(["sinfo", "-N", "-l"], check=False).stdout + self._log("slurmctld.log"))

    def start_slurmd(self, host: Host) -> None:
        (self.dir / f"spool-{host.name}").mkdir(mode=0o700, exist_ok=True)
        self._daemon(host, f"slurmd-{host.name}", ["slurmd", "-D", "-f", str(self.conf)])

    def _daemon(self, host: Host, name: str, cmd: list[str]) -> None:
        log = open(self.dir / f"{name}.out", "ab")  # noqa: SIM115 - the child owns it
        host.popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        log.close()

    def _log(self, name: str) -> str:
        path = self.dir / name
        return "\n".join(path.read_text(errors="replace").splitlines()[-30:]) if path.exists() else ""

    # ---- the client commands, run on host 0 as a user on the login node would ----
    def run(self, cmd: Sequence[str], *, check: bool = True, env: Mapping[str, str] | None = None,
            host: Host | None = None, cwd: str | Path | None = None) -> subprocess.CompletedProcess[str]:
        return (host or self.head).run(cmd, env={**self.env, **(env or {})}, check=check, timeout=60,
                                       cwd=cwd or self.dir)

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(["scontrol", *args], check=check)

    def sbatch(self, args: Sequence[str], env: Mapping[str, str], cwd: str | Path) -> str:
        out = self.run(["sbatch", "--parsable", *args], env=env, cwd=cwd).stdout.strip()
        return out.split(";")[0]

    def idle(self) -> set[str]:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout
        return {n for n, state in (line.split() for line in out.splitlines() if line.strip()) if state == "idle"}

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, NodeList, Restarts, ExitCode, ...)."""
        out = self.scontrol("show", "job", "-o", job_id, check=False).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait_state(self, job_id: str, *states: str, timeout: float = 120) -> dict[str, str]:
        return wait_for(lambda: (j := self.job(job_id)).get("JobState") in states and j, timeout,
                        f"job {job_id} in {states}", lambda: f"{self.job(job_id)}\n{self._log('slurmctld.log')}")

    def close(self) -> None:
        """The daemons die with their hosts (``Cluster.close``); this keeps their logs beside the
        cluster's (``<workdir>/slurm-logs``) and removes the run's directory."""
        keep = self.cluster.workdir / "slurm-logs"
        keep.mkdir(exist_ok=True)
        for log in [*self.dir.glob("*.log"), *self.dir.glob("*.out"), self.dir / "munge" / "munged.log"]:
            if log.exists():
                shutil.copy(log, keep / log.name)
        shutil.rmtree(self.dir, ignore_errors=True)

