"""Heartbeats from the training loop to ``tierckpt run``: progress, hangs and non-finite losses.

    import tierckpt.monitor as monitor
    for step in range(start, total):
        loss = train_step()
        monitor.step(step, loss=loss.item())      # one beat per step; a NaN/Inf loss is a fault

Call order: ``step()`` from the training loop of every rank, once per step (``beat()`` marks
progress without a new step; ``Checkpointer.save`` calls it). Under ``tierckpt run`` each
local rank writes one small record into a file of the launcher's (``TIERCKPT_MONITOR_DIR``,
``LOCAL_RANK``); the launcher polls it every monitor interval. Writing costs one ``pwrite`` of
48 bytes and never blocks on the launcher. Without the launcher every call is a no-op
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
from dataclasses import dataclass

__all__ = ["NON_FINITE_LOSS", "Beat", "SaveWatch", "beat", "read_beat", "step", "watch_save"]

NON_FINITE_LOSS = "NonFiniteLoss"
# seq, step, wall time, loss, flags (bit 0: loss is non-finite), crc32 of the rest
_FMT = struct.Struct("<QqddQ")
_REC = struct.Struct("<QqddQI")
_FLAG_NON_FINITE = 1
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


class _Writer:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._seq = 0
        self._step = _NO_STEP
        self._loss = math.nan
        self._flags = 0
        self._lock = threading.Lock()

    def write(self, step: int | None, loss: float | None) -> None:
        with self._lock:
            self._seq += 1
            if step is not None:
                self._step = int(step)
            if loss is not None:
                self._loss = float(loss)
                if not math.isfinite(self._loss):
                    self._flags |= _FLAG_NON_FINITE
            body = _FMT.pack(self._seq, self._step, time.time(), self._loss, self._flags)
            os.pwrite(self._fd, body + struct.pack("<I", zlib.crc32(body)), 0)


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
    directory = os.environ.get("TIERCKPT_MONITOR_DIR")
    local_rank = os.environ.get("LOCAL_RANK", "0")
    _writer = _Writer(os.path.join(directory, f"beat_{int(local_rank)}")) if directory else None
    return _writer


def step(step: int, loss: float | None = None, **metrics: float) -> None:
    """Report that training step ``step`` finished, with its loss; a NaN or Inf loss is a fault.

    ``metrics`` (e.g. ``samples_per_s=...``) are accepted for forward compatibility and
    currently only checked for finiteness like the loss. A non-finite value also holds back this
    process's saves (``Checkpointer.save``) until a later step reports a finite loss.
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
    if writer is not None:
        writer.write(step, float("nan") if bad and loss is None else loss)


def beat() -> None:
    """Mark progress without a new step (e.g. inside a long save or evaluation)."""
    writer = _get_writer()
    if writer is not None:
        writer.write(None, None)


def read_beat(path: str) -> Beat | None:
    """The launcher's side: the newest record in ``path``, None if absent or torn."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_REC.size)
    except FileNotFoundError:
        return None
    if len(raw) != _REC.size:
        return None
    seq, step_, t, loss, flags, crc = _REC.unpack(raw)
    if zlib.crc32(raw[: _FMT.size]) != crc:
        return None
    return Beat(
        seq=seq,
        step=None if step_ == _NO_STEP else step_,
        time=t,
        loss=None if math.isnan(loss) and not flags & _FLAG_NON_FINITE else loss,
        non_finite=bool(flags & _FLAG_NON_FINITE),
    )
