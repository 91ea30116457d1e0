"""Warm restarts for ``tierckpt run``: standby interpreters that become workers, inside torch's process context.

Call order (agent side; the standby's side is ``tierckpt.launcher.workers.standby``):
  1. ``StandbyPool(policy, entrypoint, base_env)``, then ``fill()`` as the agent starts: it
     spawns ``policy.workers`` standbys (each imports torch while the rendezvous runs) and
     ``policy.spare`` more at ``SCHED_IDLE``, for a second fault soon after the first.
  2. Each (re)start builds a ``WarmSubprocessContext`` (torch's ``SubprocessContext``, the
     same polling, failure capture, log files, tee threads and kill-by-process-group) whose
     ``_start`` hands a rank to a live standby when the command is a ``python -u [-m] ...``
     line and the environment that matters at import time is the one the standby started
     with; otherwise, or when the hand-over fails, it starts the rank cold as torch does.
  3. ``fill(idle=True)`` right after each (re)start: the replacements import at ``SCHED_IDLE``
     (CPU no running process wants, so they do not slow the restart they follow; a standby
     returns to ``SCHED_OTHER`` when it becomes a worker); ``close()`` retires every unused standby.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from torch.distributed.elastic.multiprocessing.api import RunProcsResult, SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import (
    SubprocessHandler,
    get_subprocess_handler,
)

from tierckpt.launcher.workers.standby import set_idle

__all__ = ["IMPORT_TIME_PREFIXES", "Standby", "StandbyPool", "WarmPolicy", "WarmSubprocessContext", "drain_closers",
           "kill_if_standby", "warmable"]

#: environment read while Python and torch start: a standby started under other values is not used
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "GOMP_", "CUDA_", "HIP_", "ROCR_", "TORCH_")


@dataclass(frozen=True, kw_only=True)
class WarmPolicy:
    """How many standby interpreters an agent keeps, and what they import ahead.

    workers   standbys a (re)start takes (0: every start is cold); ``tierckpt run`` defaults
              to the number of local workers
    spare     standbys kept beyond ``workers``, so that a fault right after a restart (before
              the replacements finished their imports) is served warm too; ``tierckpt run``
              keeps as many as ``workers``
    imports   modules imported beside torch and the DDP constructor's lazy imports
    loaders   ``MODULE:FUNCTION`` data loader factories each standby builds and starts ahead
              (``--warm-loader``; ``tierckpt.data.prewarm``): the script takes them with
              ``tierckpt.data.ahead``
    """

    workers: int = 0
    imports: tuple[str, ...] = field(default_factory=tuple)
    loaders: tuple[str, ...] = field(default_factory=tuple)
    spare: int = 0


def warmable(entrypoint: str, args: tuple[Any, ...]) -> bool:
    """Whether the command is a Python interpreter running ``-u -m mod ...`` or ``-u script ...``
    (torchrun's command line unless ``--no-python``/``--run-path``)."""
    python = os.path.basename(entrypoint).startswith("python") or \
        os.path.realpath(entrypoint) == os.path.realpath(sys.executable)
    if not python or len(args) < 2 or args[0] != "-u":
        return False
    if args[1] == "-m":
        return len(args) >= 3
    return not str(args[1]).startswith("-")


def script_argv(args: tuple[Any, ...]) -> list[str]:
    """``sys.argv`` of the script a ``warmable`` command line runs (``-u -m mod a b`` → ``[mod, a, b]``)."""
    rest = [str(a) for a in args[1:]]
    if rest[:1] == ["-m"]:
        return rest[1:]
    return rest


def import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)}


class Standby:
    """One standby interpreter: its process (own session, like torch's workers) and socket."""

    def __init__(self, executable: str, imports: tuple[str, ...], env: dict[str, str], *, idle: bool = False,
                 loaders: str = "") -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.executable = executable
        self.env = env
        self.idle = idle
        self.started = time.time()
        try:
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                [executable, "-u", "-m", "tierckpt.launcher.workers.standby", str(theirs.fileno()), ",".join(imports),
                 f"{self.started:.6f}", *([loaders] if loaders else [])],
                env=env, pass_fds=(theirs.fileno(),), stdout=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        if idle:  # before Python started a thread: every thread it makes inherits the policy
            set_idle(True, self.proc.pid)
        self.sock = ours
        self._ready = False
        self.ready_after_s: float | None = None  # spawn -> imports done, as first seen by ready()

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self) -> bool:
        """Whether its imports are done (non-blocking)."""
        if not self._ready and select.select([self.sock], [], [], 0)[0]:
            try:
                self._ready = self.sock.recv(1, socket.MSG_DONTWAIT) == b"R"
            except OSError:
                return False
            if self._ready:
                self.ready_after_s = time.time() - self.started
        return self._ready

    def hand_over(self, args: tuple[Any, ...], env: dict[str, str], stdout: int, stderr: int) -> None:
        """Send the rank's command line, environment and output descriptors; OSError if it is gone."""
        if self.idle:  # still importing at SCHED_IDLE, perhaps: it is the rank's process from now on
            set_idle(False, self.pid)
        body = json.dumps({"executable": self.executable, "args": [str(a) for a in args], "env": env,
                           "cwd": os.getcwd()}).encode()
        socket.send_fds(self.sock, [body], [stdout, stderr])
        self.sock.close()

    def retire(self) -> None:
        self.sock.close()
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # D-state: leave it; never wedge the agent
            pass


def kill_if_standby(pid: int) -> None:
    """SIGKILL ``pid`` if it is still a standby interpreter or a warm worker (not a reused pid).

    A warm worker outlives a SIGKILLed agent as a cold one does, and its command line is the
    standby's, not the script's: harnesses that clean up after killed agents find it by pid.
    """
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"tierckpt.launcher.workers.standby" not in f.read():
                return
        os.kill(pid, signal.SIGKILL)
    except OSError:  # gone already (ProcessLookupError is an OSError)
        pass


class StandbyPool:
    """The standbys of one agent; see the module doc for the call order."""

    def __init__(self, policy: WarmPolicy, executable: str, base_env: dict[str, str], *,
                 script_args: tuple[Any, ...] = ()) -> None:
        self.policy = policy
        self.executable = executable
        self.base_env = base_env
        # what the loader factories see as sys.argv: the script's command line (args: "-u", ["-m"], script, ...)
        self.loaders = json.dumps({"loaders": list(policy.loaders), "argv": script_argv(script_args)}) \
            if policy.loaders else ""
        self._idle: list[Standby] = []
        self._reported: set[int] = set()
        self.died: list[tuple[int, int | None]] = []  # (pid, exit code) of standbys dead before use

    def _reap(self) -> None:
        for sb in [s for s in self._idle if not s.alive()]:
            self._idle.remove(sb)
            self.died.append((sb.pid, sb.proc.returncode))
            sb.retire()

    @property
    def target(self) -> int:
        return self.policy.workers + self.policy.spare if self.policy.workers > 0 else 0

    def fill(self, *, idle: bool = False) -> int:
        """Drop dead standbys, start new ones up to ``workers + spare``; the number started.
        Those beyond the first ``workers`` live ones, or all with ``idle``, import at SCHED_IDLE."""
        self._reap()
        n = 0
        while len(self._idle) < self.target:
            low = idle or len(self._idle) >= self.policy.workers
            self._idle.append(Standby(self.executable, self.policy.imports, dict(self.base_env), idle=low,
                                      loaders=self.loaders))
            n += 1
        return n

    def newly_ready(self) -> list[Standby]:
        """Standbys whose imports finished since the last call (for events)."""
        out = [sb for sb in self._idle if sb.pid not in self._reported and sb.ready()]
        self._reported.update(sb.pid for sb in out)
        return out

    def workers_ready(self) -> bool:
        """As many standbys finished their imports as there are local workers (a node joining a
        running job waits for this; the spares beyond them import at SCHED_IDLE, maybe for long)."""
        return sum(1 for sb in self._idle if sb.ready()) >= min(self.policy.workers, len(self._idle))

    @property
    def short(self) -> bool:
        """Fewer live standbys than the policy keeps (dead ones are dropped and listed in ``died``)."""
        self._reap()
        return len(self._idle) < self.target

    def take(self, env: Mapping[str, str]) -> Standby | None:
        """A live standby whose import-time environment equals ``env``'s (ready ones first)."""
        want = import_time_env(env)
        self._reap()
        for sb in sorted(self._idle, key=lambda s: not s.ready()):
            if import_time_env(sb.env) == want:
                self._idle.remove(sb)
                return sb
        return None

    def close(self) -> None:
        for sb in self._idle:
            sb.retire()
        self._idle = []


class _WarmHandler(SubprocessHandler):
    """torch's handler around a standby's process instead of a new one (same ``proc``, ``close``)."""

    def __init__(self, standby: Standby, args: tuple[Any, ...], env: dict[str, str], stdout: str | None,
                 stderr: str | None, local_rank_id: int, mode: Literal["w", "a"] = "w") -> None:
        self._stdout = open(stdout, mode) if stdout else None  # noqa: SIM115 - closed by close()
        self._stderr = open(stderr, mode) if stderr else None  # noqa: SIM115
        env_vars = os.environ.copy()
        env_vars.update(env)
        self.local_rank_id = local_rank_id
        out = self._stdout.fileno() if self._stdout else sys.stdout.fileno()
        err = self._stderr.fileno() if self._stderr else sys.stderr.fileno()
        try:
            standby.hand_over(args, env_vars, out, err)
        except OSError:
            for f in (self._stdout, self._stderr):
                if f is not None:
                    f.close()
            standby.retire()
            raise
        self.proc = standby.proc


class _AppendHandler(SubprocessHandler):
    """torch's cold handler, its output appended to the rank's log files (a replacement's)."""

    def __init__(self, entrypoint: str, args: tuple[Any, ...], env: dict[str, str], stdout: str | None,
                 stderr: str | None, local_rank_id: int) -> None:
        self._stdout = open(stdout, "a") if stdout else None  # noqa: SIM115 - closed by close()
        self._stderr = open(stderr, "a") if stderr else None  # noqa: SIM115
        self.local_rank_id = local_rank_id
        self.proc = self._popen((entrypoint, *[str(a) for a in args]), {**os.environ, **env})


class WarmSubprocessContext(SubprocessContext):
    """torch's ``SubprocessContext`` whose ranks are served by standbys when they can be.

    Unlike torch's, a failed rank does not stop the others at the poll: the agent decides, and
    either stops them all (``close``) or ``replace``s the dead rank alone (replace.py).
    """

    def __init__(self, *, pool: StandbyPool | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pool = pool
        self.warm_ranks: list[int] = []

    def _start(self) -> None:
        if self.subprocess_handlers:
            raise ValueError("the workers were started already")
        for local_rank in range(self.nprocs):
            handler, warm = self._handler(local_rank, self.envs[local_rank], append=False)
            if warm:
                self.warm_ranks.append(local_rank)
            self.subprocess_handlers[local_rank] = handler

    def _handler(self, local_rank: int, env: dict[str, str], *, append: bool) -> tuple[SubprocessHandler, bool]:
        """A process for ``local_rank``: (its handler, whether a standby serves it)."""
        entry, args = str(self.entrypoint), self.args[local_rank]
        out, err = self.stdouts[local_rank], self.stderrs[local_rank]
        # a NUMA-bound rank runs under numactl: cold (a standby's memory is not on that node)
        usable = self.pool is not None and self._numa_options is None and warmable(entry, args)
        sb = self.pool.take({**os.environ, **env}) if self.pool is not None and usable else None
        if sb is not None:
            try:
                return _WarmHandler(sb, args, env, out, err, local_rank, mode="a" if append else "w"), True
            except OSError:  # it died meanwhile: cold
                pass
        if append:  # a replacement: torch's handler would truncate the rank's log (numactl is not applied)
            return _AppendHandler(entry, args, env, out, err, local_rank), False
        return get_subprocess_handler(entrypoint=entry, args=args, env=env, stdout=out, stderr=err,
                                      local_rank_id=local_rank, numa_options=self._numa_options), False

    def replace(self, local_rank: int, extra_env: Mapping[str, str]) -> tuple[int, bool]:
        """Start ``local_rank`` again alone (its process died; the others run on): a standby if one
        fits, else cold, with its first environment plus ``extra_env``. (pid, whether warm)."""
        old = self.subprocess_handlers[local_rank]
        for f in (old._stdout, old._stderr):
            if f is not None and not f.closed:
                f.close()
        env = {**self.envs[local_rank], **extra_env}
        handler, warm = self._handler(local_rank, env, append=True)
        self.subprocess_handlers[local_rank] = handler
        self._failures.pop(local_rank, None)
        self._running_local_ranks.add(local_rank)
        return int(handler.proc.pid), warm

    def _poll(self) -> Any:
        """torch's poll, without stopping the other ranks when one failed (the agent does, or not)."""
        done: set[int] = set()
        self._capture_process_failures(done)
        self._running_local_ranks.difference_update(done)
        if not self._failures:
            return super()._poll()
        return RunProcsResult(failures=dict(self._failures), stdouts=self.stdouts, stderrs=self.stderrs)

    def _close(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        super()._close(death_sig=death_sig, timeout=timeout)
        # torch closes a handler's log files only when it signals a live process: one that exited
        # (the crash that caused a restart) would keep its two descriptors open in the agent
        for handler in self.subprocess_handlers.values():
            for f in (handler._stdout, handler._stderr):
                if f is not None and not f.closed:
                    f.close()

    def close(self, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
        """Stop the processes now; let the tee threads finish in the background.

        torch's ``close`` also joins the tee threads, which sleep 0.1 s between reads, once per
        stream: ~0.15 s on every stop, on the restart path. The processes are gone when this
        returns; the remaining output lines still reach the console (``drain_closers`` at exit).
        """
        self._close(death_sig=death_sig or signal.SIGTERM, timeout=timeout)
        t = threading.Thread(target=self._finish_close, name="tierckpt-tee-close", daemon=True)
        t.start()
        _closers.append(t)

    def _finish_close(self) -> None:
        for tail_log in self._tail_logs:
            tail_log.stop()
        for f in (self.filtered_stdout, self.filtered_stderr):
            if f is not None:
                f.close()


_closers: list[threading.Thread] = []


def drain_closers(timeout_s: float = 10.0) -> None:
    """Wait for the background ends of ``WarmSubprocessContext.close`` (the last output lines)."""
    deadline = time.monotonic() + timeout_s
    while _closers:
        _closers.pop().join(max(0.0, deadline - time.monotonic()))
