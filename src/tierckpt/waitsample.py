"""Where a worker's main thread waits: in user code, or in torch (a collective) — for the launcher.

A silent rank that uses no CPU is either waiting in a collective for a peer (a symptom, or a
deadlock when every rank does) or waiting in its own code (an evaluation that sleeps on a remote
service, a data loader stall, a lock that never frees). CPU counters cannot tell them apart; the
main thread's stack can. Under ``tierckpt run`` the first ``tierckpt.monitor`` call in a worker
starts one daemon thread (``tierckpt-where``) that every ``INTERVAL_S`` reads the main thread's
innermost Python frame (``sys._current_frames``: no ptrace, no extra permission) and writes one
21-byte record, ``(wall time, sequence, code, site)``, to ``$TIERCKPT_MONITOR_DIR/where_<LOCAL_RANK>``
with one ``pwrite``. ``site`` is a CRC-32 of where the wait is: the innermost user frame (file and
line: the call that entered torch, or the user's own wait) and the innermost function's name, so
ranks waiting at the same place have the same site and one that waits elsewhere (a collective the
others never join) stands out (``decide/diagnose.odd_ones``). Measured cost: see docs/launcher.md (a few microseconds a sample, 4 samples a second).

Codes: ``USER`` the innermost frame is outside torch and tierckpt (``time.sleep``, a socket or pipe
read, ``threading.Event.wait``, a DataLoader's queue: ``torch/utils/data`` and the demo's training
loop, ``tierckpt/demo``, count as user code);
``LIB`` it is inside torch (a collective's ``work.wait()``, autograd); ``SAVE`` inside a
tierckpt call (a checkpoint's save, load or wait: storage I/O, an S3 retry's backoff), which is
no hang before the ceiling, nor are the ranks waiting for it in a collective. Standard-library
frames (``threading``, ``queue``, ``selectors``) are transparent: their caller decides (``where``).
A thread that cannot take the GIL (the main thread in a long native call that holds it) writes
nothing, so its record goes stale: the launcher then knows nothing (``read_where`` is None).

Call order: worker side ``start(directory, local_rank)`` (monitor.py does it, once per process);
launcher side ``read_wait(path, now)`` (code and site) or ``read_where`` (the code) at each poll of a
silent rank.
"""

from __future__ import annotations

import os
import struct
import sys
import sysconfig
import threading
import time
import zlib
from types import FrameType

from tierckpt import workerenv

__all__ = ["INTERVAL_S", "LIB", "SAVE", "STALE_S", "USER", "classify", "read_wait", "read_where", "site", "start",
           "where"]

INTERVAL_S = 0.25
STALE_S = 2.0  # a record older than this says nothing (the sampler could not run)
USER = 1
LIB = 2
SAVE = 3
_REC = struct.Struct("<dQBI")  # wall time, the sampler's sequence number, the code, the site
_LIB_DIRS = tuple(os.sep + d + os.sep for d in ("torch", "tierckpt"))
_USER_IN_LIB = tuple(os.sep + os.path.join(*d) + os.sep for d in (("torch", "utils", "data"), ("tierckpt", "demo")))
_TIERCKPT = os.sep + "tierckpt" + os.sep
# tierckpt's own monitoring (a beat, this sampler starting) is no checkpoint I/O
_NOT_SAVE = tuple(_TIERCKPT + f for f in ("monitor.py", "waitsample.py"))
# the standard library's own frames (threading's Condition.wait, queue, selectors, socket) are
# transparent: the frame that called them says whose wait it is
_PATHS = sysconfig.get_paths()
_STDLIB = tuple({form + os.sep for k in ("stdlib", "platstdlib") if (p := _PATHS.get(k))
                 for form in (p, os.path.realpath(p))})  # a venv names it through its own prefix too

_started: tuple[int, str] | None = None  # (pid, path) of the running sampler


def classify(frame: FrameType | None) -> int:
    """``USER`` or ``LIB`` for the innermost frame of a stack (None: ``USER``)."""
    if frame is None:
        return USER
    name = frame.f_code.co_filename
    if any(d in name for d in _USER_IN_LIB):
        return USER
    return LIB if any(d in name for d in _LIB_DIRS) else USER


def _stdlib(frame: FrameType) -> bool:
    """A frame that says nothing of whose wait it is: the standard library's, or tierckpt's own
    monitoring (a beat, this sampler starting)."""
    name = frame.f_code.co_filename
    return name.startswith("<") or name.endswith(_NOT_SAVE) or (name.startswith(_STDLIB) and "site-packages" not in name)


def where(frame: FrameType | None) -> int:
    """Where a whole stack waits: ``USER``, ``LIB`` or ``SAVE``. Standard-library frames are skipped
    from the inside out; the first other frame decides: user code is ``USER``; inside torch or
    tierckpt it is ``LIB``, or ``SAVE`` when a tierckpt frame (a checkpoint's save, load or wait:
    storage I/O, S3 retries) lies between it and the user code that called in."""
    f = frame
    while f is not None and _stdlib(f):
        f = f.f_back
    if f is None or classify(f) == USER:
        return USER
    while f is not None and (classify(f) == LIB or _stdlib(f)):
        if _TIERCKPT in f.f_code.co_filename and not _stdlib(f):
            return SAVE
        f = f.f_back
    return LIB


def site(frame: FrameType | None) -> int:
    """CRC-32 of where a stack waits: the innermost user frame's file and line, and the innermost
    function's name (0: no stack)."""
    if frame is None:
        return 0
    user: FrameType | None = frame
    while user is not None and classify(user) != USER:
        user = user.f_back
    at = f"{user.f_code.co_filename}:{user.f_lineno}" if user is not None else ""
    return zlib.crc32(f"{at}|{frame.f_code.co_name}".encode())


def start(directory: str, local_rank: int) -> None:
    """Start this process's sampler (again after a fork); a no-op when it runs already."""
    global _started
    path = os.path.join(directory, workerenv.where_file(int(local_rank)))
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
            os.pwrite(fd, _REC.pack(time.time(), seq, where(frame), site(frame)), 0)
        except OSError:
            return  # a write error (a full /dev/shm): the launcher then sees a stale record, as without a sampler
        del frame
        time.sleep(INTERVAL_S)


def read_wait(path: str, now: float | None = None) -> tuple[int, int] | None:
    """The launcher's side: ``(code, site)`` from a fresh record, else None."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_REC.size)
    except OSError:
        return None
    if len(raw) < _REC.size:
        return None
    t, _seq, code, where = _REC.unpack(raw)
    if (time.time() if now is None else now) - t > STALE_S or code not in (USER, LIB, SAVE):
        return None
    return int(code), int(where)


def read_where(path: str, now: float | None = None) -> int | None:
    """``USER``, ``LIB`` or ``SAVE`` from a fresh record, else None."""
    got = read_wait(path, now)
    return None if got is None else got[0]
