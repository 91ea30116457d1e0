"""The first round's seats (``launcher/membership/seats.py``) and the spare gate that uses them
(``spares.SpareGate(seats=...)``), on a real TCPStore with one client per agent; a seat holder
that dies before the round formed is a real process killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.unit.launcher.conftest import client as _client
from tierckpt.launcher.membership import seats
from tierckpt.launcher.membership.seats import FirstSeats, SeatBeat, SeatWatch, holder, take
from tierckpt.launcher.membership.spares import (
    JobEnded,
    SpareGate,
    arrivals,
    finished,
    open_seats,
    publish_nodes,
    spares_waiting,
)

SRC = str(Path(__file__).resolve().parents[3] / "src")


def _seats(server: Any, identity: str, stale_s: float = 1.0) -> FirstSeats:
    return FirstSeats(identity, stale_s=stale_s, connect=lambda: _client(server))


class _Gate:
    """``SpareGate.wait`` of one agent in a thread: its result, its exception, its standby calls."""

    def __init__(self, gate: SpareGate) -> None:
        self.gate = gate
        self.standby: list[int] = []
        gate.on_standby = self.standby.append
        self.result: list[float | None] = []
        self.error: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result.append(self.gate.wait())
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error.append(exc)

    def done(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()


def _wait(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s: {what}")


def test_the_first_max_agents_take_the_seats_the_rest_are_spares(server: Any) -> None:
    """Eight agents race for the three seats of ``--nnodes 1:3``, each on its own client: exactly
    three seats, each bound to one identity and back to it."""
    got: dict[str, int | None] = {}
    clients = [_client(server) for _ in range(8)]
    start = threading.Barrier(8)

    def agent(i: int) -> None:
        start.wait()
        got[f"h{i}:/m"] = take(clients[i], f"h{i}:/m", 3)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    seated = {ident: s for ident, s in got.items() if s is not None}
    assert len(got) == 8 and sorted(seated.values()) == [0, 1, 2], got
    assert all(holder(server, s) == ident for ident, s in seated.items())


def test_a_restarted_launcher_gets_its_own_seat_back_without_a_ticket(server: Any) -> None:
    assert take(server, "a:/m", 2) == 0
    assert take(server, "b:/m", 2) == 1
    tickets = int(server.add("tierckpt/run/first-seat/tickets", 0))
    assert take(server, "a:/m", 2) == 0  # the same host and memory root, a new launcher process
    assert take(server, "b:/m", 2) == 1
    assert int(server.add("tierckpt/run/first-seat/tickets", 0)) == tickets
    assert take(server, "c:/m", 2) is None  # a third node is a spare


def test_the_seat_beat_moves_and_stops_once_the_round_formed(server: Any) -> None:
    assert take(server, "a:/m", 2) == 0
    beat = SeatBeat(lambda: _client(server), 0, every_s=0.05).start()
    key = "tierckpt/run/first-seat/beat/0"
    first = int(server.add(key, 0))
    _wait(lambda: int(server.add(key, 0)) >= first + 3, 5, "the beat moves")
    publish_nodes(server, 2)
    _wait(lambda: not beat._thread.is_alive(), 5, "the beat ends by itself once the node count is published")
    then = int(server.add(key, 0))
    time.sleep(0.2)
    assert int(server.add(key, 0)) == then
    beat.stop()


def test_a_spare_never_takes_a_live_holders_seat(server: Any) -> None:
    """``SeatWatch`` over a real store with a simulated clock: seats whose holders beat stay
    theirs however long the spare watches; a seat that stops beating is free after ``stale_s``."""
    for ident in ("a:/m", "b:/m"):
        take(server, ident, 2)
    watch = SeatWatch(_client(server), "c:/m", 2, stale_s=5.0)
    for now in range(0, 30, 2):
        seats.beat(server, 0)
        seats.beat(server, 1)
        assert watch.poll(now=float(now)) is None
    for now in range(30, 34):  # seat 1's holder went silent after t=28; seat 0's beats on
        seats.beat(server, 0)
        assert watch.poll(now=float(now)) is None, now
    seats.beat(server, 0)
    assert watch.poll(now=34.0) == 1  # > 5 s since its pair last moved (seen at t=28)
    assert holder(server, 1) == "c:/m" and holder(server, 0) == "a:/m"
    assert take(server, "b:/m", 2) is None  # the silent holder, back: it lost its seat, a spare now
    assert take(server, "c:/m", 2) == 1


def test_a_spare_takes_the_seat_of_a_holder_killed_before_the_round(server: Any) -> None:
    """Node b took seat 1 and beats from its own process, then dies (SIGKILL) before the round
    formed: the spare waiting at the gate takes seat 1 after ``stale_s`` (and not before), and
    enters the round as a seat holder; node a's seat stays a's."""
    assert take(server, "a:/m", 2) == 0
    a_beat = SeatBeat(lambda: _client(server), 0, every_s=0.1).start()
    code = ("import datetime, sys, time, torch.distributed as dist\n"
            "from tierckpt.launcher.membership.seats import SeatBeat, take\n"
            f"s = dist.TCPStore('127.0.0.1', {server.port}, is_master=False, timeout=datetime.timedelta(seconds=10))\n"
            "seat = take(s, 'b:/m', 2)\n"
            f"SeatBeat(lambda: dist.TCPStore('127.0.0.1', {server.port}, is_master=False), seat, every_s=0.1).start()\n"
            "print(seat, flush=True)\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=SRC))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"1"
        key = "tierckpt/run/first-seat/beat/1"
        seen = int(server.add(key, 0))
        _wait(lambda: int(server.add(key, 0)) > seen + 2, 10, "b's beat moves")
        spare = _Gate(SpareGate(_client(server), 2, lambda n: None, poll_s=0.02, seat_poll_s=0.1,
                                seats=_seats(server, "c:/m", stale_s=3.0)))
        _wait(lambda: spare.standby, 5, "the spare stands by while the round forms")
        assert spare.standby == [0]  # job_nodes 0: the first round has not formed
        assert not spare.done(2.0), "the spare took a seat while both holders beat"
        os.kill(proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        assert spare.done(15), "the spare never took the dead holder's seat"
        waited = time.monotonic() - t_kill
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    assert not spare.error, spare.error
    assert spare.result and spare.result[0] is not None  # it stood by: its ``since`` is reported on joining
    assert waited >= 3.0 - 0.5, waited  # its last beat came at most one beat before the kill
    assert holder(server, 1) == "c:/m" and holder(server, 0) == "a:/m"
    assert spare.gate.beat is not None and spare.gate.beat.seat == 1  # its seat beats now, for the next spare
    assert spares_waiting(server) == 0 and arrivals(server) == 0
    spare.gate.beat.stop()
    a_beat.stop()


def test_a_first_round_spare_goes_on_at_the_gate_once_the_round_formed(server: Any) -> None:
    """The round formed on MAX: the first-round spare draws a gate ticket, says it stands by only
    once, and enters when survivors open a seat."""
    for ident in ("a:/m", "b:/m"):
        take(server, ident, 2)
    spare = _Gate(SpareGate(_client(server), 2, lambda n: None, poll_s=0.02, seat_poll_s=0.1,
                            seats=_seats(server, "c:/m", stale_s=60.0)))
    _wait(lambda: spare.standby, 5, "the spare stands by")
    publish_nodes(server, 2)
    _wait(lambda: spares_waiting(server) == 1, 5, "the spare holds a gate ticket")
    assert not spare.done(0.3)
    open_seats(server, 0, 0, 1)
    assert spare.done(5) and not spare.error, spare.error
    assert spare.standby == [0] and spare.result[0] is not None
    assert spare.gate.beat is None  # it never held a first-round seat


def test_a_first_round_spare_of_an_elastic_job_formed_below_max_joins_as_an_arrival(server: Any) -> None:
    """``--nnodes 1:2``: two seats; the round formed on one node (torch's last call); the agent
    beyond MAX is no longer needed as a spare: it joins the running job, counted as an arrival."""
    for ident in ("a:/m", "b:/m"):
        take(server, ident, 2)
    spare = _Gate(SpareGate(_client(server), 2, lambda n: None, poll_s=0.02, seat_poll_s=0.1,
                            seats=_seats(server, "c:/m", stale_s=60.0)))
    _wait(lambda: spare.standby, 5, "the spare stands by")
    publish_nodes(server, 1)
    assert spare.done(5) and not spare.error, spare.error
    assert arrivals(server) == 1 and spares_waiting(server) == 0


def test_a_seated_agent_and_a_late_one_pass_the_gate_without_standing_by(server: Any) -> None:
    gate = SpareGate(_client(server), 2, lambda n: pytest.fail("stood by"), seats=_seats(server, "a:/m"))
    assert gate.wait() is None and gate.beat is not None and gate.beat.seat == 0
    gate.beat.stop()
    publish_nodes(server, 1)  # the job formed below MAX: a late agent joins it as an arrival, no seat
    late = SpareGate(_client(server), 2, lambda n: pytest.fail("stood by"), seats=_seats(server, "b:/m"))
    assert late.wait() is None and late.beat is None and arrivals(server) == 1


def test_a_spare_of_a_finished_job_leaves_after_every_node_passed_its_exit_barrier(server: Any) -> None:
    """The spare may host the store: it leaves only once both nodes called ``finished``."""
    publish_nodes(server, 2)
    spare = _Gate(SpareGate(_client(server), 2, lambda n: None, poll_s=0.02))
    _wait(lambda: spare.standby, 5, "the spare stands by")
    server.set("tierckpt/run/done/0", b"1")
    finished(server)
    assert not spare.done(0.5), "the spare left before the second node passed its exit barrier"
    finished(server)
    assert spare.done(5) and isinstance(spare.error[0], JobEnded) and "finished" in str(spare.error[0])


# ---- a repeat offender standing aside waits behind the other spares ----

def test_an_offender_at_the_gate_lets_a_later_spare_take_the_first_seat(server: Any) -> None:
    """The offender stood aside first (ticket 1), a spare came after (ticket 2): the first seat
    opened goes to the spare; the offender takes the next one, when no other spare waits."""
    publish_nodes(server, 2)
    offender = _Gate(SpareGate(_client(server), 2, lambda n: None, poll_s=0.02, offender=True))
    _wait(lambda: spares_waiting(server) == 1, 5, "the offender stands by")
    spare = _Gate(SpareGate(_client(server), 2, lambda n: None, poll_s=0.02))
    _wait(lambda: spares_waiting(server) == 2, 5, "the spare stands by behind it")
    open_seats(server, 0, 0, 1)
    assert spare.done(5) and not spare.error, spare.error
    assert not offender.done(0.5), "the offender took the seat while another spare waited"
    assert spares_waiting(server) == 1  # the offender, still counted as a spare at the gate
    open_seats(server, 1, 0, 1)
    assert offender.done(5) and not offender.error, offender.error
    assert spares_waiting(server) == 0


def test_an_offender_alone_at_the_gate_takes_the_seat(server: Any) -> None:
    publish_nodes(server, 2)
    offender = _Gate(SpareGate(_client(server), 2, lambda n: None, poll_s=0.02, offender=True))
    _wait(lambda: spares_waiting(server) == 1, 5, "the offender stands by")
    open_seats(server, 0, 0, 1)
    assert offender.done(5) and not offender.error, offender.error
    assert spares_waiting(server) == 0


def test_two_offenders_and_a_spare_share_two_seats_without_losing_one(server: Any) -> None:
    publish_nodes(server, 2)
    first = _Gate(SpareGate(_client(server), 2, lambda n: None, poll_s=0.02, offender=True))
    _wait(lambda: spares_waiting(server) == 1, 5, "offender 1 stands by")
    second = _Gate(SpareGate(_client(server), 2, lambda n: None, poll_s=0.02, offender=True))
    _wait(lambda: spares_waiting(server) == 2, 5, "offender 2 stands by")
    spare = _Gate(SpareGate(_client(server), 2, lambda n: None, poll_s=0.02))
    _wait(lambda: spares_waiting(server) == 3, 5, "the spare stands by")
    open_seats(server, 0, 0, 2)
    assert spare.done(5) and not spare.error, spare.error
    _wait(lambda: first.done(0) or second.done(0), 5, "one offender takes the second seat")
    time.sleep(0.3)
    assert first.done(0) != second.done(0), "both offenders, or neither, passed with one seat left"
    assert spares_waiting(server) == 1
    server.set("tierckpt/run/done/0", b"1")  # the job ends: the offender still waiting leaves the gate
    finished(server)
    finished(server)
    assert first.done(5) and second.done(5)
    assert [type(e) for g in (first, second) for e in g.error] == [JobEnded]
