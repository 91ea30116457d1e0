"""The recovery benchmarks' job and scratch space, shared by ``recovery.py`` and ``recovery_inprocess.py``."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from tierckpt.launcher.workers.warm import kill_if_standby
from tierckpt.testing.twonode import TwoNodeJob

__all__ = ["RecoveryJob", "scratch", "torch_version"]


class RecoveryJob(TwoNodeJob):
    """``TwoNodeJob`` with the launcher modes of this benchmark: warm, cold (``--no-warm``), torchrun."""

    def __init__(self, mode: str, root: Path, shm_parent: Path, *, steps: int, step_time: float) -> None:
        super().__init__("torchrun" if mode == "torchrun" else "tierckpt", root, shm_parent, steps=steps,
                         step_time=step_time)
        self.mode = mode

    def command(self, node: int) -> list[str]:
        cmd = super().command(node)
        return [*cmd[:4], "--no-warm", *cmd[4:]] if self.mode == "cold" else cmd  # [python, -m, tierckpt.cli, run]

    def close(self) -> None:
        """``TwoNodeJob.close``, then every traced worker still alive: a warm worker's command line
        is its standby's, so the search by work directory does not find one orphaned by its agent."""
        super().close()
        for pid in self.pids():
            kill_if_standby(pid)

    def standbys_ready(self) -> bool:
        """Each agent reported a standby whose imports finished after its last (re)start."""
        ev = self.events()
        for node in (0, 1):
            mine = [e for e in ev if e.get("node") == node]
            starts = [e["time"] for e in mine if e["event"] in ("started", "restart")]
            if not starts or not any(e["event"] == "standby" and "ready" in e and e["time"] > max(starts)
                                     for e in mine):
                return False
        return True


def torch_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # noqa: BLE001 - only a label in the report
        return None


@contextlib.contextmanager
def scratch(shm_dir: str, logs: str | None) -> Iterator[tuple[Path, Path]]:
    """(logs, shm): fresh directories, removed on exit, on error and on SIGTERM (``logs`` kept if given)."""
    shm = Path(tempfile.mkdtemp(prefix=f"tierckpt-recovery-{os.getpid()}-", dir=shm_dir))
    if logs is not None:
        Path(logs).mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="tierckpt-recovery-", dir=logs))
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if in_main else None
    try:
        yield log_dir, shm
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(shm, ignore_errors=True)
        if logs is None:
            shutil.rmtree(log_dir, ignore_errors=True)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
