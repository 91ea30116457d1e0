"""Where a worker's main thread waits: in user code, or in torch (a collective) — for the launcher.

A silent rank that uses no CPU is either waiting in a collective for a peer (a symptom, or a
deadlock when every rank does) or waiting in its own code (an evaluation that sleeps on a remote
service, a data loader stall, a lock that never frees). CPU counters cannot tell them apart; the
main thread's stack can. Under ``tierckpt run`` the first ``tierckpt.monitor`` call in a worker
starts one daemon thread (``tierckpt-where``) that every ``INTERVAL_S`` reads the main thread's
innermost Python frame (``sys._current_frames``: no ptrace, no extra permission) and writes one
17-byte record, ``(wall time, code)``, to ``$TIERCKPT_MONITOR_DIR/where_<LOCAL_RANK>`` with one
``pwrite``. Measured cost: see docs/launcher.md (a few microseconds a sample, 4 samples a second).

Codes: ``USER`` the innermost frame is outside torch and tierckpt (``time.sleep``, a socket or pipe
read, ``threading.Event.wait``, a DataLoader's queue: ``torch/utils/data`` and the demo's training
loop, ``tierckpt/demo``, count as user code);
``LIB`` it is inside torch or tierckpt (a collective's ``work.wait()``, autograd, a DCP save).
A thread that cannot take the GIL (the main thread in a long native call that holds it) writes
nothing, so its record goes stale: the launcher then knows nothing (``read_where`` is None).

Call order: worker side ``start(directory, local_rank)`` (monitor.py does it, once per process);
launcher side ``read_where(path, now)`` at each poll of a silent rank.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
import time
from types import FrameType

__all__ = ["INTERVAL_S", "LIB", "STALE_S", "USER", "classify", "read_where", "start"]

INTERVAL_S = 0.25
STALE_S = 2.0  # a record older than this says nothing (the sampler could not run)
USER = 1
LIB = 2
_REC = struct.Struct("<dQB")  # wall time, the sampler's sequence number, the code
_LIB_DIRS = tuple(os.sep + d + os.sep for d in ("torch", "tierckpt"))
_USER_IN_LIB = tuple(os.sep + os.path.join(*d) + os.sep for d in (("torch", "utils", "data"), ("tierckpt", "demo")))

_started: tuple[int, str] | None = None  # (pid, path) of the running sampler


def classify(frame: FrameType | None) -> int:
    """``USER`` or ``LIB`` for the innermost frame of a stack (None: ``USER``)."""
    if frame is None:
        return USER
    name = frame.f_code.co_filename
    if any(d in name for d in _USER_IN_LIB):
        return USER
    return LIB if any(d in name for d in _LIB_DIRS) else USER


def start(directory: str, local_rank: int) -> None:
    """Start this process's sampler (again after a fork); a no-op when it runs already."""
    global _started
    path = os.path.join(directory, f"where_{int(local_rank)}")
    if _started == (os.getpid(), path):
        return
    _started = (os.getpid(), path)
    main = threading.main_thread().ident
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    threading.Thread(target=_run, args=(fd, main), name="tierckpt-where", daemon=True).start()


def _run(fd: int, main: int | None) -> None:
    seq = 0
    while True:
        frame = sys._current_frames().get(main) if main is not None else None
        seq += 1
        try:
            os.pwrite(fd, _REC.pack(time.time(), seq, classify(frame)), 0)
        except OSError:
            return  # a write error (a full /dev/shm): the launcher then sees a stale record, as without a sampler
        del frame
        time.sleep(INTERVAL_S)


def read_where(path: str, now: float | None = None) -> int | None:
    """The launcher's side: ``USER`` or ``LIB`` from a fresh record, else None."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_REC.size)
    except OSError:
        return None
    if len(raw) < _REC.size:
        return None
    t, _seq, code = _REC.unpack(raw)
    if (time.time() if now is None else now) - t > STALE_S or code not in (USER, LIB):
        return None
    return int(code)
