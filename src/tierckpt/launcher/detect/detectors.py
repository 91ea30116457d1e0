"""One node's local detectors, as one part: what its workers show becomes ``FaultRecord`` values.

``Detectors`` owns the heartbeat trackers (heartbeat.py, one per local rank and generation), what
earlier generations taught them (``learned``, hang.py's ``Profile``), the log-rule monitors
(rules.py over logwatch.py's readers), and this node's side of the busy/wait board (busyboard.py).
It reads the beat and wait files of ``beat_dir`` (written by the workers: monitor.py,
waitsample.py) and the workers' ``/proc`` (procwatch.py); it decides nothing: the records go to
``decide.diagnose`` with the evidence of the other parts (deadlines, liveness, arrivals).

Call order (the supervisor's, one agent per node):

    det = Detectors(heartbeat_policy, log_rules, beat_dir)      # once
    det.learned.merge(profile)                                  # what the restart-state file kept
    det.follow(board)                                           # after every rendezvous round or regroup
    det.arm(local_ranks, outputs, now)                          # each process generation, once started
    det.rearm(now)                                              # after an in-process restart
    each poll: det.crash(failures, outputs, since=..., expired=...)   # a local worker failed, else
               det.silent(now, generation=..., nnodes=..., pids=..., ranks=...)  # beats, /proc, waits, rules
    det.calibration()   # the ``timeout`` event's fields, once per generation when every tracker calibrated
    det.progress(), det.all_beat(), det.nan_step(), det.first_step(), det.timeout()  # for claims and events
    det.learn()         # the merged profile (the restart-state file's ``hang``)
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tierckpt import workerenv
from tierckpt.launcher.decide.diagnose import odd_ones
from tierckpt.launcher.decide.faults import FaultRecord, Kind
from tierckpt.launcher.detect.busyboard import BusyBoard
from tierckpt.launcher.detect.hang import LIB_WAIT, SAVE_WAIT, USER_WAIT, Profile
from tierckpt.launcher.detect.heartbeat import BeatTracker, HeartbeatPolicy
from tierckpt.launcher.detect.logwatch import LineReader
from tierckpt.launcher.detect.procwatch import sample_ranks, wait_places
from tierckpt.launcher.detect.rules import RuleMonitor
from tierckpt.launcher.detect.symptom import peer_failure, tail
from tierckpt.monitor import NON_FINITE_LOSS, read_beat

__all__ = ["Detectors"]


class Detectors:
    """See the module docstring for the call order."""

    def __init__(self, heartbeat: HeartbeatPolicy, log_rules: Sequence[Any], beat_dir: str) -> None:
        self.heartbeat = heartbeat
        self.log_rules = list(log_rules)
        self.beat_dir = beat_dir
        self.learned = Profile()  # hang evidence of earlier generations (kept in the restart-state file)
        self.trackers: dict[int, BeatTracker] = {}
        self._rules: dict[tuple[int, str], tuple[LineReader, RuleMonitor]] = {}
        self._board: BusyBoard | None = None  # which nodes have a busy or waiting silent rank
        self._calibrated = False

    # ---- arming ----
    def follow(self, board: BusyBoard) -> None:
        """The board of the new membership (its keys are per generation)."""
        self._board = board

    def arm(self, local_ranks: Iterable[int], outputs: Sequence[Mapping[int, str]], now: float) -> None:
        """A new process generation: fresh trackers (with what was learned) and log readers over
        the workers' output files (``outputs``: stdouts, stderrs by local rank)."""
        learned = self.learn()
        self.trackers = {lr: BeatTracker(self.heartbeat, now, learned) for lr in local_ranks}
        for reader, _ in self._rules.values():
            reader.close()
        self._rules = {}
        if self.log_rules:
            for stream in outputs:
                for local_rank, path in stream.items():
                    if path:
                        self._rules[(local_rank, path)] = (LineReader(path), RuleMonitor(self.log_rules, now))
        self._calibrated = False

    def rearm(self, now: float) -> None:
        """After an in-process restart: the steps went back and paused, as at a start."""
        learned = self.learn()
        self.trackers = {lr: BeatTracker(self.heartbeat, now, learned) for lr in self.trackers}

    def learn(self) -> Profile:
        """What this generation's heartbeats taught, added to what earlier ones did."""
        for tr in self.trackers.values():
            self.learned.merge(tr.profile)
        return self.learned

    def close(self) -> None:
        for reader, _ in self._rules.values():
            reader.close()
        self._rules = {}

    # ---- a poll ----
    @staticmethod
    def crash(failures: Mapping[int, Any], outputs: Sequence[Mapping[int, str]], *, since: float | None,
              expired: Mapping[int, str] | None = None) -> FaultRecord:
        """The local failure to name: killed or exited, the first that is no symptom of a peer's
        failure (symptom.py), else the first, marked a symptom with the output line that shows it.
        ``outputs``: stderrs, then stdouts, by local rank; ``expired``: torch's file timers by pid."""
        rank, failure, symptom = _primary_failure(failures, outputs)
        code = getattr(failure, "exitcode", None)
        killed = isinstance(code, int) and code < 0
        detail = f"killed by {signal.Signals(-code).name}" if isinstance(code, int) and code < 0 else f"exit code {code}"
        pid = getattr(failure, "pid", None)
        if expired and isinstance(pid, int) and pid in expired:
            detail += f" (torch's file timer {expired[pid]!r} expired)"
        return FaultRecord(kind=Kind.KILLED if killed else Kind.EXITED, reason="Crash", rank=rank, detail=detail,
                           since=since, symptom=symptom, evidence={"exitcode": code} if isinstance(code, int) else {})

    def silent(self, now: float, *, generation: int, nnodes: int, pids: Mapping[int, int],
               ranks: Mapping[int, int]) -> list[FaultRecord]:
        """Heartbeats, the /proc evidence of silent ranks, where idle ranks wait, and log rules.
        ``pids`` and ``ranks``: each local rank's worker pid and global rank."""
        out: list[FaultRecord] = []
        for local_rank, tr in self.trackers.items():
            tr.observe(read_beat(os.path.join(self.beat_dir, workerenv.beat_file(local_rank))), now)
        board = self._board
        # silent ranks' processes from /proc: stopped, idle or busy (hang.py)
        peer_busy = sample_ranks(self.trackers, pids, now, None if board is None else
                                 lambda busy, ask: board.exchange(generation, nnodes, busy, ask))
        started = set()  # local ranks whose output matched a log rule: started, as a first beat says
        for (local_rank, _), (reader, mon) in self._rules.items():
            for line in reader.lines():
                mon.feed(line, now)
            if mon.matched:
                started.add(local_rank)
        where = wait_places(self.trackers, self.beat_dir)  # idle ranks: in their own code or in torch, and where
        mine = {ranks[lr]: w for lr, w in where.items() if lr in ranks}
        waits = {} if board is None else board.waits(
            generation, nnodes, mine, ask=any(tr.idle_suspect() for tr in self.trackers.values()))
        waits.update(mine)
        odd = odd_ones(waits)  # the ranks idle where the majority is not (a collective the others never join)
        for local_rank, tr in self.trackers.items():
            rank = ranks.get(local_rank)
            code = where[local_rank][0] if local_rank in where else None
            others = [c for r, (c, _) in waits.items() if r != rank]
            problem = tr.check(now, peer_busy=peer_busy[local_rank], started=local_rank in started, where=code,
                               peer_user_wait=USER_WAIT in others, peer_lib_wait=LIB_WAIT in others,
                               peer_save_wait=SAVE_WAIT in others)
            since = tr.last_change or tr.start
            if problem is None and code != LIB_WAIT:
                continue  # the common case: nothing to record, no idle stretch to measure again
            idle = round(tr.evidence.idle_for(), 3) if tr.evidence.known else None
            if problem is None:  # evidence only: the early sign of a peer that is not in the collective
                out.append(FaultRecord(kind=Kind.COLLECTIVE_WAIT, reason="Hang", rank=rank, since=since,
                                       step=tr.step, detail=f"idle in a collective for {idle}s",
                                       symptom="waits in a collective", evidence={"idle_s": idle}))
                continue
            kind = Kind.NON_FINITE if problem[0] == NON_FINITE_LOSS else Kind.STOPPED if tr.stopped() else Kind.STALL
            detail, symptom = problem[1], None
            evidence: dict[str, Any] = {"idle_s": idle, "where": code}
            if kind is Kind.STALL and rank in odd:
                detail += f"; it waits where ranks {sorted(set(waits) - odd)} do not"
                evidence["odd_one"] = True
            elif kind is Kind.STALL and (code == LIB_WAIT or (peer_busy[local_rank] and not tr.evidence.busy())):
                # it waits for others: the rank(s) waiting elsewhere, or a busy one, are the suspects
                symptom = "idle in a collective" if code == LIB_WAIT else "waits for a busy rank"
                if odd:
                    evidence["suspects"] = sorted(odd)
                if peer_busy[local_rank]:
                    evidence["waits_for"] = "a busy rank"
            out.append(FaultRecord(kind=kind, reason=problem[0], rank=rank, detail=detail, since=since,
                                   step=tr.step, symptom=symptom, evidence=evidence))
        for (local_rank, _), (_reader, mon) in self._rules.items():
            verdict = mon.check(now)
            if verdict is not None:
                out.append(FaultRecord(kind=Kind.LOG_RULE, reason=verdict.reason, rank=ranks.get(local_rank),
                                       detail=verdict.detail, since=now))
        return out

    # ---- what the beats say ----
    def calibration(self) -> dict[str, float] | None:
        """Once per generation, when every tracker calibrated: the ``timeout`` event's fields."""
        if self._calibrated or not self.trackers or not all(t.calibrated for t in self.trackers.values()):
            return None
        self._calibrated = True
        hang, learned = self.heartbeat.hang, self.learn()
        return {"heartbeat_timeout_s": round(self.timeout() or 0.0, 3),
                "longest_interval_s": round(max(t.longest for t in self.trackers.values()), 3),
                "idle_limit_s": round(hang.idle_limit(learned), 3), "hang_ceiling_s": round(hang.ceiling(learned), 3)}

    def timeout(self) -> float | None:
        """The largest heartbeat timeout of the local ranks now (None: none bounded)."""
        return max((t.timeout() or 0.0 for t in self.trackers.values()), default=0.0) or None

    def all_beat(self) -> bool:
        """Every local worker of this generation has sent its first heartbeat."""
        return bool(self.trackers) and all(t.first_beat for t in self.trackers.values())

    def progress(self) -> int | None:
        """The highest step a local rank beat this generation."""
        steps = [t.step for t in self.trackers.values() if t.step is not None]
        return max(steps) if steps else None

    def first_step(self) -> int | None:
        """The lowest first step a local rank beat this generation."""
        first = [t.first_step for t in self.trackers.values() if t.first_step is not None]
        return min(first) if first else None

    def nan_step(self) -> int | None:
        """The lowest step at which a local rank beat a non-finite loss this generation, if any."""
        return min((t.step for t in self.trackers.values() if t.non_finite and t.step is not None), default=None)

    def steps(self) -> list[tuple[int | None, bool]]:
        """(step, non-finite) of every local rank (control/resume.moved_past)."""
        return [(t.step, t.non_finite) for t in self.trackers.values()]


def _primary_failure(failures: Mapping[int, Any],
                     outputs: Sequence[Mapping[int, str]]) -> tuple[int | None, Any, str | None]:
    """(rank, failure, symptom): the first failure that shows no peer's failure, else the first
    with the output line that showed one."""
    first: tuple[int | None, Any, str | None] = (None, None, None)
    for rank, failure in sorted(failures.items()):
        code = getattr(failure, "exitcode", None)
        local_rank = getattr(failure, "local_rank", -1)  # -1: no output file to read
        line = None
        if isinstance(code, int) and code > 0:  # a signal is its own cause
            line = next((hit for stream in outputs if (hit := peer_failure(tail(stream.get(local_rank))))), None)
        if line is None:
            return rank, failure, None
        if first[0] is None:
            first = (rank, failure, line)
    return first

