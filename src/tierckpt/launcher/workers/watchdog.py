"""torchrun's worker watchdog (torch's file timer) under ``tierckpt run``, minus the agent's suicide.

``TORCHELASTIC_ENABLE_FILE_TIMER=1`` makes torchrun's agent run a ``FileTimerServer`` on a FIFO
(``TORCHELASTIC_TIMER_FILE``, given to every worker) where ``FileTimerClient`` timers
(``torch.distributed.elastic.timer.expires``) are registered; an expired timer SIGKILLs its
worker. torch's server then SIGKILLs its own process too, the agent, so under torchrun the whole
node goes away. Here only the worker is killed: the agent sees a ``Crash`` (its detail names the
expired timer) and restarts the job in place like any other fault.

Call order (the agent, at every (re)start): ``start_watchdog(envs)`` adds the FIFO's path to every
worker's environment and returns the running server (None when not enabled); the previous
generation's server is ``stop()``ped first; ``expired`` lists the workers it killed.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Any

from torch.distributed.elastic.timer.file_based_local_timer import FileTimerServer

__all__ = ["ENABLE", "TIMER_FILE", "WorkerWatchdog", "start_watchdog"]

ENABLE = "TORCHELASTIC_ENABLE_FILE_TIMER"
TIMER_FILE = "TORCHELASTIC_TIMER_FILE"


class WorkerWatchdog(FileTimerServer):
    """torch's ``FileTimerServer`` that kills expired workers but never its own process."""

    def __init__(self, file_path: str, run_id: str) -> None:
        super().__init__(file_path=file_path, run_id=run_id, max_interval=0.1, daemon=True,
                         log_event=self._event)
        self.expired: dict[int, str] = {}  # worker pid -> the expired timer's scope

    def _event(self, name: str, request: Any) -> None:
        if name == "kill worker process" and request is not None:
            self.expired[int(request.worker_pid)] = str(request.scope_id)

    def _reap_worker(self, worker_pid: int, signal: int) -> bool:
        if worker_pid == os.getpid():  # torch ends its agent after reaping: here the agent recovers
            return True
        return bool(super()._reap_worker(worker_pid, signal))


def start_watchdog(envs: dict[int, dict[str, str]], run_id: str) -> WorkerWatchdog | None:
    """A running watchdog when ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` (the FIFO from
    ``TORCHELASTIC_TIMER_FILE`` or a fresh one), its path in every worker's env; else None
    (a ``TORCHELASTIC_TIMER_FILE`` given alone is passed on, as torchrun does)."""
    path = os.environ.get(TIMER_FILE)
    server = None
    if os.environ.get(ENABLE) == "1":
        path = path or os.path.join(tempfile.gettempdir(), f"watchdog_timer_{uuid.uuid4()}")
        server = WorkerWatchdog(path, run_id)
        server.start()
    if path is not None:
        for env in envs.values():
            env[TIMER_FILE] = path
    return server
