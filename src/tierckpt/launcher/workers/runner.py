"""One node's worker processes across generations: the heartbeat folder, the standby pool, the
process context of the running generation, the reaper that outlives the agent, the stop.

Call order (the supervisor; one ``Workers`` per agent process):
  1. ``Workers(env, warm=, stop_grace_s=, events=, reaper=)``: makes the heartbeat folder (the
     folders of agents that died without cleaning up go first), then ``start_pool(spec)`` before
     the first rendezvous round (the standbys import torch meanwhile).
  2. Each (re)start: ``start(wg, generation=, addr=, port=, extra=, ...)`` empties the heartbeat
     folder, builds every rank's environment (launch.py) and starts the processes (warm ones
     where a standby serves); then ``launched(wg, reaper_state)`` records the pids.
  3. Every poll: ``refill(generation)`` replaces the standbys a start consumed.
  4. A fault: ``stop()`` (SIGTERM with ``--stop-grace``, else SIGKILL), or ``replace(local_rank,
     env)`` for one dead rank of a warm context (inprocess/replace.py).
  5. ``close()``: the reaper first, then the closing contexts, the pool and the heartbeat folder.

The master port of a generation (``free_master_port``) is chosen here too: group rank 0 publishes it.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.multiprocessing.api import PContext

from tierckpt.launcher.events import Events
from tierckpt.launcher.workers.launch import start_context, worker_envs
from tierckpt.launcher.workers.reaper import Reaper
from tierckpt.launcher.workers.warm import (
    StandbyPool,
    WarmPolicy,
    WarmSubprocessContext,
    drain_closers,
    warmable,
)

__all__ = ["BEAT_PREFIX", "Workers", "free_master_port", "make_beat_dir", "remove_dead_beat_dirs"]

BEAT_PREFIX = "tierckpt-beats-"  # <tmpfs>/tierckpt-beats-<agent pid>-<random>/beat_<local rank>


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's: alive
        pass
    return False


def remove_dead_beat_dirs(parent: str) -> None:
    """Heartbeat folders of agents that died without cleaning up (SIGKILL, a lost machine)."""
    with os.scandir(parent) as entries:
        for entry in entries:
            pid = entry.name[len(BEAT_PREFIX):].split("-", 1)[0] if entry.name.startswith(BEAT_PREFIX) else ""
            if pid.isdigit() and _gone(int(pid)):
                shutil.rmtree(entry.path, ignore_errors=True)


def make_beat_dir() -> str:
    """This agent's heartbeat folder on tmpfs (``/dev/shm``, else the temporary directory)."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    remove_dead_beat_dirs(shm)
    return tempfile.mkdtemp(prefix=f"{BEAT_PREFIX}{os.getpid()}-", dir=shm)


def free_master_port(tries: int = 64) -> int:
    """A port for the workers' master store that nothing binds now, chosen outside the kernel's
    ephemeral range: between this check and the workers' bind, any outgoing connection on the
    machine may take an ephemeral port (seen as EADDRINUSE in a worker's init_process_group when
    many jobs ran side by side); no connection takes one below the range. Falls back to a port the
    kernel picks when the range leaves no room or every try is taken."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(tries if low > 12000 else 0):
        port = rng.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class Workers:
    """The running generation's processes and what serves the next one; see the module doc.

    ``env``: what every worker of every generation gets (launch.static_env), without the
    heartbeat folder, which this object owns (``beat_dir``)."""

    def __init__(self, env: Callable[[str], dict[str, str]], *, warm: WarmPolicy, stop_grace_s: float,
                 events: Events, reaper: Reaper | None = None) -> None:
        self._env = env
        self._warm = warm
        self._stop_grace_s = stop_grace_s
        self._events = events
        self._reaper = reaper
        self.beat_dir = make_beat_dir()
        self.ctx: PContext | None = None
        self.pool: StandbyPool | None = None
        self.warm_ranks: list[int] = []  # local ranks the last start served from standbys
        self._died_seen = 0

    def static_env(self) -> dict[str, str]:
        return self._env(self.beat_dir)

    def start_pool(self, spec: WorkerSpec) -> None:
        """Standby interpreters for warm (re)starts, spawned now so they import torch during the rendezvous."""
        if self._warm.workers <= 0 or not isinstance(spec.entrypoint, str) or \
                not warmable(spec.entrypoint, tuple(spec.args)):
            return
        self.pool = StandbyPool(self._warm, spec.entrypoint, {**os.environ, **self.static_env()},
                                script_args=tuple(spec.args))
        self.pool.fill()

    def start(self, wg: WorkerGroup, *, generation: int, addr: str, port: int, extra: dict[str, str],
              set_local_rank_env: Callable[[dict[str, str], int], None], logs_specs: LogsSpecs,
              prefix_template: str | None, start_method: str,
              before: Callable[[dict[int, dict[str, str]]], None] | None = None) -> PContext:
        """Start generation ``generation``'s workers on the master ``addr:port``; ``extra``: this
        generation's variables beside the static ones; ``before(envs)`` runs just before the start."""
        wg.master_addr, wg.master_port = addr, port  # type: ignore[assignment]
        shutil.rmtree(self.beat_dir, ignore_errors=True)
        os.makedirs(self.beat_dir)
        envs, args = worker_envs(wg, generation=generation, addr=addr, port=port,
                                 static={**self.static_env(), **extra}, set_local_rank_env=set_local_rank_env)
        if before is not None:
            before(envs)
        self.ctx, self.warm_ranks = start_context(wg, envs, args, logs_specs=logs_specs,
                                                  prefix_template=prefix_template, pool=self.pool,
                                                  start_method=start_method)
        return self.ctx

    def launched(self, wg: WorkerGroup, **reaper_state: Any) -> None:
        """After ``start``: the workers' pids into the group, the reaper told what to stop and claim."""
        ids = self.ctx.pids() if self.ctx is not None else {}
        for local_rank, pid in ids.items():
            wg.workers[local_rank].id = pid
        wg.state = WorkerState.HEALTHY
        if self._reaper is not None:
            self._reaper.update(**reaper_state)
            self._reaper.watch(list(ids.values()))

    def pids(self) -> dict[int, int]:
        return dict(self.ctx.pids()) if self.ctx is not None else {}

    def refill(self, generation: int) -> None:
        """Replace consumed standbys at once, at SCHED_IDLE: their imports take only CPU that the
        restarted workers leave, and the spares (``WarmPolicy.spare``) serve a fault meanwhile."""
        pool = self.pool
        if pool is None:
            return
        for sb in pool.newly_ready():
            self._events.emit("standby", generation=generation, ready=sb.pid,
                              import_s=round(sb.ready_after_s or 0.0, 3))
        if pool.short:
            started = pool.fill(idle=True)
            if started:
                self._events.emit("standby", generation=generation, started=started)
        for pid, code in pool.died[self._died_seen:]:
            self._events.emit("warning", generation=generation,
                              what=f"standby {pid} exited with {code} before use; a new one replaces it")
        self._died_seen = len(pool.died)

    def workers_ready(self) -> bool:
        """Every standby a start takes has finished its imports (True without a pool)."""
        return self.pool is None or self.pool.workers_ready()

    def stop(self) -> None:
        """Stop the running generation: SIGTERM and ``--stop-grace`` seconds, else SIGKILL at once."""
        if self.ctx is not None:
            sig = signal.SIGTERM if self._stop_grace_s > 0 else signal.SIGKILL
            self.ctx.close(sig, timeout=max(1, int(self._stop_grace_s)))

    def replaceable(self) -> bool:
        """Whether one rank can be restarted alone (a warm context can; torch's own cannot)."""
        return isinstance(self.ctx, WarmSubprocessContext)

    def replace(self, local_rank: int, extra_env: dict[str, str]) -> tuple[int, bool]:
        """Start one process for ``local_rank`` (warm if a standby serves): (pid, warm)."""
        ctx = self.ctx
        if not isinstance(ctx, WarmSubprocessContext):
            raise RuntimeError("tierckpt run: only a warm process context replaces one rank")
        pid, warm = ctx.replace(local_rank, extra_env)
        if self._reaper is not None:
            self._reaper.watch(list(ctx.pids().values()))
        return pid, warm

    def close(self) -> None:
        """The reaper first (the workers were stopped already), then the slow parts."""
        if self._reaper is not None:
            self._reaper.close()
            self._reaper = None
        drain_closers()
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        shutil.rmtree(self.beat_dir, ignore_errors=True)
