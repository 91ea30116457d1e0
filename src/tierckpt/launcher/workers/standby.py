"""A warm standby interpreter of ``tierckpt run``: torch imported ahead, then it becomes a worker.

Started by the agent (``tierckpt.launcher.workers.warm.StandbyPool``) as

    python -u -m tierckpt.launcher.workers.standby FD MODULE,MODULE... SPAWN_TIME [LOADERS_JSON]

Call order (a spare is put at ``SCHED_IDLE`` by the agent as it is spawned, and back to
``SCHED_OTHER`` as a rank is handed to it): import torch, the modules the DDP constructor imports lazily, and the user's
``--warm-imports`` (a failing import is reported on stderr and skipped: the script will meet
it again itself); build the ``--warm-loader`` loaders (LOADERS_JSON: ``{"loaders": ["MOD:FN"],
"argv": [script, args...]}``; ``tierckpt.data.prewarm.build``: their worker processes fork and
warm up now, the script takes them with ``tierckpt.data.ahead``; a factory that fails is
reported on stderr and skipped); ``gc.freeze()`` what they created; never touch CUDA; send ``R`` on the socket FD (ready); block until the agent
hands over a rank: one SEQPACKET message, JSON ``{"env", "args", "cwd"}`` with the worker's
stdout and stderr as SCM_RIGHTS descriptors. Then return every thread to ``SCHED_OTHER``, put those on fds 1 and 2, take the
environment, cwd and argv, and run the script as ``__main__`` (``runpy``), exactly as
``python -u -m mod ...`` or ``python -u script.py ...`` would. Its exit is the worker's exit.

A standby that would run stale code (a module it imported from outside the interpreter's
install changed on disk since, or CUDA was initialised) does not run it warm: it
``execve``s the cold command line in place, same pid, same process group, same descriptors,
so the agent's monitoring cannot tell and nothing hangs. End of file on the socket (the
agent went away or retired it) ends the standby.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import socket
import sys
import sysconfig
import time
from typing import Any

from tierckpt import workerenv

# what the DDP constructor imports lazily (torch._dynamo: ~1.3 s on first use)
DEFAULT_IMPORTS = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo")
MAX_MESSAGE = 1 << 20


def _installed_roots() -> tuple[str, ...]:
    """Directories of the interpreter's own install: code there does not change under a job."""
    paths = sysconfig.get_paths()
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, paths.get("stdlib", ""), paths.get("purelib", ""),
             paths.get("platlib", "")}
    return tuple(os.path.realpath(r) + os.sep for r in roots if r)


def user_files() -> dict[str, int]:
    """Source files of imported modules outside the interpreter's install, with their mtimes."""
    roots = _installed_roots()
    out: dict[str, int] = {}
    for mod in list(sys.modules.values()):
        path = getattr(mod, "__file__", None)
        if not isinstance(path, str):
            continue
        real = os.path.realpath(path)
        if real.startswith(roots):
            continue
        try:
            out[real] = os.stat(real).st_mtime_ns
        except OSError:
            continue
    return out


def stale_reason(files: dict[str, int]) -> str | None:
    """Why running warm would differ from a cold start, or None."""
    for path, mtime in files.items():
        try:
            if os.stat(path).st_mtime_ns != mtime:
                return f"{path} changed since the standby imported it"
        except OSError:
            return f"{path} is gone since the standby imported it"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "CUDA was initialised before a rank was assigned"
    return None


def _warm_up(names: list[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the script meets it again itself, cold
            print(f"tierckpt standby: warm import {name!r} failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)


def _receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    try:
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
    except OSError:
        return None
    if not data:
        return None
    return json.loads(data.decode()), list(fds)


def set_idle(idle: bool, pid: int | None = None) -> None:
    """``SCHED_IDLE`` (True) or ``SCHED_OTHER`` (False) for every thread of process ``pid`` (None:
    this one).

    Linux lets an unprivileged process leave ``SCHED_IDLE`` for ``SCHED_OTHER`` at its own nice
    value (unlike a raised nice value, which it could not lower again), for its own threads and
    those of its user's processes; threads created while idle inherit it, so all are switched.
    A refusal leaves the policy as it was (reported on stderr).
    """
    policy = getattr(os, "SCHED_IDLE" if idle else "SCHED_OTHER", None)
    if policy is None:  # not Linux
        return
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{'self' if pid is None else pid}/task")]
    except OSError:
        tids = [0] if pid is None else [pid]
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as exc:
            print(f"tierckpt standby: scheduling policy not changed ({exc})", file=sys.stderr, flush=True)
            return


def _build_loaders(raw: str, fd: int) -> None:
    """The ``--warm-loader`` loaders, built and started (their workers close ``fd``, the agent's
    socket)."""
    spec = json.loads(raw) if raw else {}
    loaders = list(spec.get("loaders") or [])
    if not loaders:
        return
    # by name, as the user's modules: worker-side library code that runs in this interpreter, which
    # becomes the worker (the launcher itself never uses the data pipeline)
    prewarm: Any = importlib.import_module(workerenv.PREWARM)
    for problem in prewarm.build(loaders, argv=spec.get("argv"), close_fds=(fd,)):
        print(f"tierckpt standby: warm loader not built ahead (the script builds it itself): {problem}",
              file=sys.stderr, flush=True)


def _loader_workers() -> list[int]:
    prewarm = sys.modules.get(workerenv.PREWARM)
    return list(prewarm.worker_pids()) if prewarm is not None else []


def _take_over(job: dict[str, Any], fds: list[int]) -> None:
    """Become the worker: scheduling, descriptors, environment, cwd."""
    set_idle(False)
    for pid in _loader_workers():  # forked at SCHED_IDLE: they serve the worker now
        set_idle(False, pid)
    sys.stdout.flush()
    sys.stderr.flush()
    for target, fd in zip((1, 2), fds, strict=False):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])


def _run(args: list[str]) -> None:
    """Run ``-u -m mod ...`` or ``-u script ...`` as ``__main__`` in this interpreter."""
    rest = args[1:]  # args[0] is "-u", which this interpreter was started with
    if rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        script = rest[0]
        sys.argv = [script, *rest[1:]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def main() -> None:
    fd = int(sys.argv[1])
    names = [*DEFAULT_IMPORTS, *(n for n in (sys.argv[2] if len(sys.argv) > 2 else "").split(",") if n)]
    spawned = sys.argv[3] if len(sys.argv) > 3 else f"{time.time():.6f}"  # the agent's clock at spawn
    sock = socket.socket(fileno=fd)
    _warm_up(names)
    _build_loaders(sys.argv[4] if len(sys.argv) > 4 else "", fd)
    # the imports' objects live as long as the process: keep them out of every collection,
    # including the one at exit (with torch._dynamo loaded it takes ~1.3-3 s at exit, here)
    gc.collect()
    gc.freeze()
    files = user_files()
    try:
        sock.send(b"R")
    except OSError:  # the agent handed a rank over and closed its end already: the message waits
        pass
    got = _receive(sock)
    if got is None:  # retired, or the agent is gone
        sys.exit(0)
    job, fds = got
    sock.close()
    _take_over(job, fds)
    why = stale_reason(files)
    if why is not None:
        env = {**os.environ, workerenv.WARM: "0"}
        print(f"tierckpt standby: cold start ({why})", file=sys.stderr, flush=True)
        prewarm = sys.modules.get(workerenv.PREWARM)
        if prewarm is not None:  # its workers would outlive the exec, waiting for a parent that is gone
            prewarm.discard()
        os.execve(job["executable"], [job["executable"], *job["args"]], env)
    os.environ[workerenv.WARM] = "1"
    os.environ[workerenv.WARM_SINCE] = spawned
    _run(list(job["args"]))


if __name__ == "__main__":
    main()
