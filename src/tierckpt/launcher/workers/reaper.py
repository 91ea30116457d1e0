"""Workers stop within a second when their agent dies: a reaper process per agent watches a pipe.

torch's workers run in their own sessions, so a SIGKILLed ``tierckpt run`` (OOM killer, a
killed container runtime, ``kill -9``) left them training unprotected until their collectives
failed (~10 s, nothing replicating), and the survivors then blamed their own ranks with
``Crash``. ``PR_SET_PDEATHSIG`` is no fix: it fires on the death of the *thread* that forked
the worker and turned lost nodes into crashes. Here the agent holds the write end of a pipe
whose read end only the reaper has; the kernel closes it when the agent dies, however it dies.

Call order (agent side, ``tierckpt run``):
  1. ``Reaper.fork()`` in ``launch`` before the rendezvous handler exists (no thread or socket
     of torch's yet): a forked child, so torch (for a store client) is already imported.
  2. ``reaper.update(...)`` after every (re)start: the rendezvous store's address, the
     generation, this node's group rank, the workers' pids (each its own process group), the
     events file.
  3. ``reaper.close()`` on every orderly exit: the reaper kills any worker still alive,
     claims nothing, and exits.

Reaper side, at end of file without a goodbye (the agent died): claim ``LostNode`` for this
node in the store for the current generation (``JobControl.claim``: the first claim wins, so
the survivors' events name the lost node), then SIGKILL the workers' process groups (each
checked by its start time, so a reused pid is left alone), append a ``fault`` event to this
node's events file, exit. If the store is gone too (this node hosted it), the workers are
killed all the same and the survivors report ``LostStore``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

__all__ = ["Reaper", "start_time"]

_CLAIM_TIMEOUT_S = 2.0


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(") ", 1)[1].split()[19])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


class Reaper:
    """The agent's handle on its reaper: the pipe's write end and the reaper's pid."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid = pid
        self._fd: int | None = fd

    @classmethod
    def fork(cls) -> Reaper:
        """Fork the reaper (call it while the agent has no threads: before torch's rendezvous handler)."""
        r, w = os.pipe()  # both non-inheritable: workers started later never hold the write end
        pid = os.fork()
        if pid == 0:  # the reaper
            code = 0
            try:
                os.close(w)
                _child(r)
            except BaseException:  # noqa: BLE001 - a forked child must never return into the agent's code
                code = 1
            finally:
                os._exit(code)
        os.close(r)
        return cls(pid, w)

    def update(self, **state: Any) -> None:
        """Tell the reaper what to claim and whom to stop if this agent dies now."""
        if self._fd is None:
            return
        try:
            os.write(self._fd, (json.dumps(state) + "\n").encode())
        except OSError:  # the reaper is gone (killed with the machine): nothing left to tell
            self._fd = None

    def watch(self, pids: list[int]) -> None:
        """The workers of the generation just started (each leads its own process group)."""
        self.update(workers=[[p, start_time(p)] for p in pids])

    def close(self) -> None:
        """An orderly exit: the reaper stops what is left without claiming a fault, then exits."""
        if self._fd is not None:
            self.update(bye=True)
            os.close(self._fd)
            self._fd = None
            _wait(self.pid, timeout=5.0)


def _wait(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(0.01)


def _child(fd: int) -> None:
    """The reaper's life: own session (a signal to the agent's group or terminal spares it), no
    descriptor of the agent's but the pipe and stderr, read until end of file, then act."""
    agent = os.getppid()
    os.setsid()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    keep = sorted({0, 1, 2, fd})
    for lo, hi in zip(keep, [*keep[1:], _max_fd()], strict=True):
        os.closerange(lo + 1, hi)
    state: dict[str, Any] = {}
    bye = False
    buf = b""
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            msg = json.loads(line)
            bye = bye or bool(msg.pop("bye", False))
            state.update(msg)
    t_eof = time.monotonic()
    if bye or "workers" not in state:  # an orderly exit, or the agent never started a worker
        _kill_workers(state)
        return
    claim = _claim(state, agent, t_eof)
    killed = _kill_workers(state)
    _record(state, claim, killed, time.monotonic() - t_eof)


def _max_fd() -> int:
    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (ValueError, OSError):
        return 65536


def _claim(state: dict[str, Any], agent: int, t_eof: float) -> str:
    """Claim LostNode for this node in the store; what happened, for the event."""
    store_addr, g, node = state.get("store"), state.get("generation"), state.get("node")
    if store_addr is None or g is None or node is None:
        return "no claim: the agent died before its first rendezvous"
    from tierckpt.launcher.control.jobcontrol import JobControl
    from tierckpt.launcher.control.store import connect_client

    record = {"generation": g, "time": time.time(), "generation_started": state.get("generation_started", time.time()),
              "reason": "LostNode", "node": node, "rank": None, "first_beat": True, "step": None,
              "resumed_step": state.get("resumed_step"),
              "detection_latency_s": round(time.monotonic() - t_eof, 3),  # from the agent's death (end of file)
              "detail": f"the agent of node {node} (pid {agent}) died; its reaper stopped its workers"}
    try:
        won = JobControl(connect_client(str(store_addr[0]), int(store_addr[1]), timeout_s=_CLAIM_TIMEOUT_S)
                         ).claim(int(g), record)
    except Exception as exc:  # noqa: BLE001 - the store's host may be this very node: the survivors see LostStore
        return f"no claim: the rendezvous store did not answer ({type(exc).__name__})"
    return "claimed" if won.get("reason") == "LostNode" and won.get("node") == node else \
        f"{won.get('reason')} was claimed first"


def _kill_workers(state: dict[str, Any]) -> list[int]:
    killed = []
    for pid, started in state.get("workers", []):
        if started is None or start_time(int(pid)) != started:
            continue  # gone, or the pid now names another process
        try:
            os.killpg(int(pid), signal.SIGKILL)
            killed.append(int(pid))
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def _record(state: dict[str, Any], claim: str, killed: list[int], took_s: float) -> None:
    path = state.get("events")
    line = {"event": "fault", "time": round(time.time(), 6), "generation": state.get("generation"),
            "node": state.get("node"), "reason": "LostNode", "rank": None, "by": "reaper",
            "detail": f"this node's agent died; workers {killed} killed {took_s:.3f}s after; {claim}"}
    if path:
        try:
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError:
            pass
    print(f"tierckpt run: reaper: {line['detail']}", file=sys.stderr, flush=True)
