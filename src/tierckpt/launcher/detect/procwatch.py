"""The I/O side of hang evidence: a rank's process tree read from ``/proc`` (Linux; elsewhere no evidence).

    sample = sample_tree(pid, now)            # hang.Sample, or None when the process is gone or unreadable
    busy = sample_ranks(trackers, pids, now, board.exchange)  # the agent, each poll: sample the silent
                                              # ranks, and say for each local rank whether another rank
                                              # (here, or on another node: busyboard.py) is busy and silent

One sample reads ``/proc/<pid>/stat``, ``io`` and ``task/*/stat`` of the rank and of each descendant
(data-loader workers, compilers), at most ``_MAX_PROCS`` processes: a few hundred microseconds,
taken only while a rank is silent for more than ``HangPolicy.sample_after_s``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from tierckpt import workerenv
from tierckpt.launcher.detect.hang import Sample
from tierckpt.waitsample import read_wait

if TYPE_CHECKING:
    from tierckpt.launcher.detect.heartbeat import BeatTracker

__all__ = ["sample_ranks", "sample_tree"]

_TICK = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
_MAX_PROCS = 64


def _stat(path: str) -> tuple[str, float, list[str]] | None:
    """(state, cpu seconds, the fields after the command name) of one /proc stat file."""
    try:
        with open(path, "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:  # gone between listing and reading
        return None
    fields = raw[raw.rfind(")") + 2:].split()
    if len(fields) < 13:
        return None
    return fields[0], (int(fields[11]) + int(fields[12])) * _TICK, fields


def _threads(pid: int) -> list[str]:
    """The states of every thread of ``pid`` ([] when it is gone)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    states = []
    for tid in tids:
        st = _stat(f"/proc/{pid}/task/{tid}/stat")
        if st is not None:
            states.append(st[0])
    return states


def _io(pid: int) -> int:
    """rchar + wchar of ``pid`` (0 when unreadable: then I/O is no evidence either way)."""
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        return int(fields.get(b"rchar", b"0")) + int(fields.get(b"wchar", b"0"))
    except (OSError, ValueError):
        return 0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:  # no CONFIG_PROC_CHILDREN, or the thread ended: the tree is the process alone
            continue
    return out


def sample_tree(pid: int, now: float) -> Sample | None:
    """CPU time and thread states of ``pid`` and its live descendants, as of ``now`` (monotonic)."""
    top = _stat(f"/proc/{pid}/stat")
    if top is None or top[0] in "ZX":
        return None
    own = _threads(pid)
    stopped = bool(own) and all(s in "Tt" for s in own)
    active = any(s in "RD" for s in own)
    cpu, io = top[1], _io(pid)
    todo, seen = _children(pid), {pid}
    while todo and len(seen) < _MAX_PROCS:
        child = todo.pop()
        if child in seen:
            continue
        seen.add(child)
        st = _stat(f"/proc/{child}/stat")
        if st is None or st[0] in "ZX":
            continue
        cpu += st[1]
        io += _io(child)
        active = active or any(s in "RD" for s in _threads(child))
        todo.extend(_children(child))
    return Sample(time=now, cpu_s=cpu, stopped=stopped, active=active, io_bytes=io)


def sample_ranks(trackers: Mapping[int, BeatTracker], pids: Mapping[int, int], now: float,
                 exchange: Callable[[bool, bool], bool] | None = None) -> dict[int, bool]:
    """Sample every local rank that has been silent long enough; {local rank: another one is busy and silent}.

    ``exchange(local_busy, ask)`` publishes whether a rank here is busy and silent and, when
    ``ask``, says whether one elsewhere is (``BusyBoard.exchange`` bound to the generation).
    """
    for local_rank, tr in trackers.items():
        pid = pids.get(local_rank)
        if pid is None or not tr.wants_sample(now):
            continue
        sample = sample_tree(pid, now)
        if sample is not None:
            tr.evidence.add(sample)
    busy = {lr for lr, tr in trackers.items() if tr.busy_silent()}
    elsewhere = exchange is not None and exchange(bool(busy), any(tr.idle_suspect() for tr in trackers.values()))
    return {lr: elsewhere or bool(busy - {lr}) for lr in trackers}


def wait_places(trackers: Mapping[int, BeatTracker], beat_dir: str) -> dict[int, tuple[int, int]]:
    """{local rank: (where its main thread waits: waitsample.USER / LIB, the wait's site)} for the
    ranks that are silent and idle now (a second or more without CPU or I/O) and whose sampler
    wrote lately."""
    out: dict[int, tuple[int, int]] = {}
    for local_rank, tr in trackers.items():
        if tr.evidence.known and tr.evidence.idle_for() >= 1.0:
            got = read_wait(os.path.join(beat_dir, workerenv.where_file(local_rank)))
            if got is not None:
                out[local_rank] = got
    return out
