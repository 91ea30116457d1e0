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

__all__ = ["NON_FINITE_LOSS", "Beat", "beat", "read_beat", "step"]

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
    currently only checked for finiteness like the loss.
    """
    global _warned_non_finite
    bad = loss is not None and not math.isfinite(float(loss))
    for name, value in metrics.items():
        if not math.isfinite(float(value)):
            bad = True
            _log.warning("step %s: metric %s is %s", step, name, value)
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
