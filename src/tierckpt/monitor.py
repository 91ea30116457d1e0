"""Heartbeats from the training loop to ``tierckpt run``: progress, hangs and non-finite losses.

    import tierckpt.monitor as monitor
    for step in range(start, total):
        loss = train_step()
        monitor.step(step, loss=loss.item())      # one beat per step; a NaN/Inf loss is a fault

    with monitor.section("eval", timeout_s=600):  # a known long stretch without steps
        evaluate()

Call order: ``step()`` from the training loop of every rank, once per step (``beat()`` marks
progress without a new step; ``Checkpointer.save`` calls it; ``saved()`` marks a save written
by the DCP writer, which every save path goes through; ``section()`` around a long stretch,
nested sections allowed: the innermost one is reported). Under ``tierckpt run`` each
local rank writes one small record into a file of the launcher's (``TIERCKPT_MONITOR_DIR``,
``LOCAL_RANK``); the launcher polls it every monitor interval. Writing costs one ``pwrite`` of
44 bytes (88 inside a section) and never blocks on the launcher. Without the launcher every call is a no-op
(a non-finite loss is still logged once).

A non-finite loss also holds back this process's saves: ``Checkpointer.save`` takes a
``watch_save(step)`` and does not commit while its ``reason()`` is set, i.e. when the save was
made after a non-finite ``step()`` with no finite one since, or when a non-finite ``step(M)``
with M <= the save's step arrives before its commit.
"""

from __future__ import annotations

import logging
import math
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tierckpt import workerenv

__all__ = ["NON_FINITE_LOSS", "Beat", "SaveWatch", "beat", "read_beat", "saved", "section", "set_non_finite_hook",
           "step", "watch_save"]

NON_FINITE_LOSS = "NonFiniteLoss"
# seq, step, wall time, loss, flags (bit 0: loss is non-finite), crc32 of the rest
_FMT = struct.Struct("<QqddQ")
_REC = struct.Struct("<QqddQI")
_FLAG_NON_FINITE = 1
# bit 2: this record was written by a save (``saved()``), not by the training loop
_FLAG_SAVED = 4
# the section extension, present when flags bit 1 is set: timeout_s (0: none), the name (UTF-8,
# NUL-padded), crc32 of the record's seq and the rest; a reader of the 44-byte record ignores it
_FLAG_SECTION = 2
_SEC = struct.Struct("<d32s")
_SEC_NAME_MAX = 32
_NO_STEP = -(2**63)

_log = logging.getLogger("tierckpt.monitor")


@dataclass(frozen=True)
class Beat:
    """One heartbeat record as the launcher reads it."""

    seq: int
    step: int | None
    time: float
    loss: float | None
    non_finite: bool
    section: str | None = None  # inside monitor.section(name, ...)
    section_timeout_s: float | None = None
    saved: bool = False  # written by ``saved()`` (a save), not by the training loop


class _Writer:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._seq = 0
        self._step = _NO_STEP
        self._loss = math.nan
        self._flags = 0
        self._sections: list[tuple[str, float | None]] = []
        self._lock = threading.Lock()

    def write(self, step: int | None, loss: float | None, *, saved: bool = False) -> None:
        with self._lock:
            self._seq += 1
            # after a non-finite loss the record keeps its step and loss: the launcher may read it
            # steps later, and the generations after resume below the first non-finite step
            if not self._flags & _FLAG_NON_FINITE:
                if step is not None:
                    self._step = int(step)
                if loss is not None:
                    self._loss = float(loss)
                    if not math.isfinite(self._loss):
                        self._flags |= _FLAG_NON_FINITE
            flags = self._flags | (_FLAG_SECTION if self._sections else 0) | (_FLAG_SAVED if saved else 0)
            body = _FMT.pack(self._seq, self._step, time.time(), self._loss, flags)
            rec = body + struct.pack("<I", zlib.crc32(body))
            if self._sections:
                name, timeout_s = self._sections[-1]
                ext = _SEC.pack(timeout_s or 0.0, name.encode())
                rec += ext + struct.pack("<I", zlib.crc32(body[:8] + ext))
            os.pwrite(self._fd, rec, 0)

    def enter(self, name: str, timeout_s: float | None) -> None:
        with self._lock:
            self._sections.append((name, timeout_s))
        self.write(None, None)

    def leave(self) -> None:
        with self._lock:
            self._sections.pop()
        self.write(None, None)


_writer: _Writer | None = None
_writer_pid: int | None = None
_warned_non_finite = False
_health_lock = threading.Lock()
_non_finite_since: int | None = None  # first non-finite step not yet followed by a finite loss
_watches: set[SaveWatch] = set()


class SaveWatch:
    """One save waiting to commit: ``reason()`` says why it must not be committed, or None.

    Created by ``watch_save`` (``Checkpointer.save``), checked before the commit, closed after.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        with _health_lock:
            self._since = _non_finite_since  # the save was made while the loss was non-finite
            self._arrived: int | None = None  # a non-finite step <= self.step reported after the save
            _watches.add(self)

    def reason(self) -> str | None:
        with _health_lock:
            since, arrived = self._since, self._arrived
        if since is not None:
            return (f"the loss was non-finite at step {since} (tierckpt.monitor.step) and no finite loss "
                    "was reported since; the state may hold non-finite values")
        if arrived is not None:
            return (f"a non-finite loss at step {arrived} (tierckpt.monitor.step) was reported before "
                    f"step {self.step} committed; the state may hold non-finite values")
        return None

    def close(self) -> None:
        with _health_lock:
            _watches.discard(self)


def watch_save(step: int) -> SaveWatch:
    """A ``SaveWatch`` for a save of ``step`` made now; ``close()`` it once committed or failed."""
    return SaveWatch(step)


def _record_health(step: int, bad: bool, finite_loss: bool) -> None:
    global _non_finite_since
    with _health_lock:
        if bad:
            if _non_finite_since is None:
                _non_finite_since = int(step)
            for watch in _watches:
                if step <= watch.step and watch._arrived is None:
                    watch._arrived = int(step)
        elif finite_loss:
            _non_finite_since = None


def _get_writer() -> _Writer | None:
    global _writer, _writer_pid
    pid = os.getpid()
    if _writer_pid == pid:
        return _writer
    _writer_pid = pid
    directory = os.environ.get(workerenv.MONITOR_DIR)
    local_rank = os.environ.get("LOCAL_RANK", "0")
    _writer = _Writer(os.path.join(directory, workerenv.beat_file(int(local_rank)))) if directory else None
    if directory:  # where the main thread waits when it is silent (waitsample.py)
        from tierckpt import waitsample

        waitsample.start(directory, int(local_rank))
    return _writer


def step(step: int, loss: float | None = None, **metrics: float) -> None:
    """Report that training step ``step`` finished, with its loss; a NaN or Inf loss is a fault.

    ``metrics`` (e.g. ``samples_per_s=...``) are accepted for forward compatibility and
    currently only checked for finiteness like the loss. A non-finite value also holds back this
    process's saves (``Checkpointer.save``) until a later step reports a finite loss. Under
    ``tierckpt run`` the heartbeat record keeps the first non-finite step and its loss from then on,
    so the launcher names that step however late it reads the record.
    """
    global _warned_non_finite
    bad = loss is not None and not math.isfinite(float(loss))
    for name, value in metrics.items():
        if not math.isfinite(float(value)):
            bad = True
            _log.warning("step %s: metric %s is %s", step, name, value)
    _record_health(step, bad, loss is not None)
    writer = _get_writer()
    if bad and not _warned_non_finite:
        _warned_non_finite = True
        _log.error("step %s: non-finite loss %s (%s)", step, loss, NON_FINITE_LOSS)
    hook = _non_finite_hook
    if bad and hook is not None:  # tierckpt.resilient restarts in-process and reports it itself
        hook(step, loss)
    if writer is not None:
        writer.write(step, float("nan") if bad and loss is None else loss)


_non_finite_hook: Callable[[int, float | None], None] | None = None


def set_non_finite_hook(hook: Callable[[int, float | None], None] | None) -> None:
    """Called by ``tierckpt.resilient`` only: ``hook(step, loss)`` runs (and raises) on a non-finite step."""
    global _non_finite_hook
    _non_finite_hook = hook


def beat() -> None:
    """Mark progress without a new step (e.g. inside a long save or evaluation)."""
    writer = _get_writer()
    if writer is not None:
        writer.write(None, None)


def saved() -> None:
    """This rank wrote its part of a save (called by the DCP writer, so every save path beats).

    Under ``tierckpt run`` it is progress: it meets ``startupDeadlineSeconds`` and counts as a
    generation's first beat, for a loop that never calls ``step()`` too; after a ``step()`` beat
    it resets the hang timer like ``beat()``. A rank that only saves is never called hung (its
    saves may be far apart), as a script that never beats is not."""
    writer = _get_writer()
    if writer is not None:
        writer.write(None, None, saved=True)


@contextmanager
def section(name: str, timeout_s: float | None = None) -> Iterator[None]:
    """A known long stretch without steps (an evaluation pass, a synchronous save, a compile).

    Under ``tierckpt run`` the launcher lets the rank be silent inside it until ``timeout_s``
    after it began (None: until the launcher's hang ceiling, ``--hang-ceiling``) and then calls
    it a hang, naming the section; a stopped process is still a hang at once. Entering and
    leaving each write a beat. Without the launcher it only checks its arguments.
    """
    if not name or len(name.encode()) > _SEC_NAME_MAX:
        raise ValueError(f"section name must be 1 to {_SEC_NAME_MAX} bytes of UTF-8, got {name!r}")
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"section timeout_s must be positive seconds or None, got {timeout_s!r}")
    writer = _get_writer()
    if writer is None:
        yield
        return
    writer.enter(name, timeout_s)
    try:
        yield
    finally:
        writer.leave()


def read_beat(path: str) -> Beat | None:
    """The launcher's side: the newest record in ``path``, None if absent or torn."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_REC.size + _SEC.size + 4)
    except FileNotFoundError:
        return None
    if len(raw) < _REC.size:
        return None
    seq, step_, t, loss, flags, crc = _REC.unpack_from(raw)
    if zlib.crc32(raw[: _FMT.size]) != crc:
        return None
    name: str | None = None
    timeout_s: float | None = None
    if flags & _FLAG_SECTION:
        ext = raw[_REC.size: _REC.size + _SEC.size]
        if len(raw) < _REC.size + _SEC.size + 4 or \
                zlib.crc32(raw[:8] + ext) != struct.unpack_from("<I", raw, _REC.size + _SEC.size)[0]:
            return None  # torn between the record and its extension: read again at the next poll
        sec_timeout, raw_name = _SEC.unpack(ext)
        name = raw_name.rstrip(b"\0").decode(errors="replace")
        timeout_s = sec_timeout if sec_timeout > 0 else None
    return Beat(
        seq=seq,
        step=None if step_ == _NO_STEP else step_,
        time=t,
        loss=None if math.isnan(loss) and not flags & _FLAG_NON_FINITE else loss,
        non_finite=bool(flags & _FLAG_NON_FINITE),
        section=name,
        section_timeout_s=timeout_s,
        saved=bool(flags & _FLAG_SAVED),
    )
