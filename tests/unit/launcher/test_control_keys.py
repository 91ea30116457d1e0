"""The control plane's schema (launcher/control/keys.py) and its store primitives (control/store.py).

Every key's value is pinned byte for byte: agents of one job must agree on them, and a store
written by one tierckpt version is read by another across a rolling restart of the launcher.
"""

from __future__ import annotations

import datetime
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.unit.launcher.conftest import client
from tierckpt.launcher.control import keys
from tierckpt.launcher.control.store import ABSENT, connect_client, peek, store_errors, timeout_error

PINNED = [
    (keys.GENERATION, "tierckpt/run/generation"),
    (keys.FULL_RESTARTS, "tierckpt/run/full_restarts"),
    (keys.MEMBERSHIP_CHANGES, "tierckpt/run/membership_changes"),
    (keys.UNHEALTHY_BEFORE, "tierckpt/run/unhealthy_before"),
    (keys.UNHEALTHY_NODES, "tierckpt/run/unhealthy-nodes"),
    (keys.fault(4), "tierckpt/run/fault/4"),
    (keys.fault_set(4), "tierckpt/run/fault/4/set"),
    (keys.stopped(4), "tierckpt/run/stopped/4"),
    (keys.counter_done(keys.stopped(4)), "tierckpt/run/stopped/4/done"),
    (keys.regroup(5), "tierckpt/run/regroup/5"),
    (keys.regroup_round(5), "tierckpt/run/regroup/5/"),
    (keys.exited(4), "tierckpt/run/exit/4"),
    (keys.persisted(4), "tierckpt/run/persisted/4"),
    (keys.master(4), "tierckpt/run/master/4"),
    (keys.progress(4, 2), "tierckpt/run/progress/4/2"),
    (keys.AGENT_SECRET, "tierckpt/run/agent-secret"),
    (keys.agent(3, 1), "tierckpt/run/agent/3/1"),
    (keys.done(0), "tierckpt/run/done/0"),
    (keys.beat(7, 3), "tierckpt/run/live/7/beat/3"),
    (keys.verdict(7), "tierckpt/run/live/7/verdict"),
    (keys.resume_bound(4), "tierckpt/run/resume/bound/4"),
    (keys.resume_past(4), "tierckpt/run/resume/past/4"),
    (keys.resume_nonfinite(4), "tierckpt/run/resume/nonfinite/4"),
    (keys.busy(4, 1), "tierckpt/run/busy/4/1"),
    (keys.wait(4, 1), "tierckpt/run/wait/4/1"),
    (keys.inproc_store(4), "tierckpt/run/inproc-store/4"),
    (keys.OFFENSES, "tierckpt/run/offenses"),
    (keys.keep_out(4), "tierckpt/run/keep-out/4"),
    (keys.keep_out_full(4), "tierckpt/run/keep-out/full/4"),
    (keys.machine("h1:/dev/shm/tierckpt"), "tierckpt/run/machine/h1:/dev/shm/tierckpt"),
    (keys.AVOID, "tierckpt/run/avoid"),
    (keys.STORE_HOST, "tierckpt/run/store-host"),
    (keys.NODES, "tierckpt/run/nodes"),
    (keys.SEATS, "tierckpt/run/seats"),
    (keys.seats_opened(4), "tierckpt/run/seats/4"),
    (keys.SPARE_TICKETS, "tierckpt/run/spare-tickets"),
    (keys.offender_ticket(2), "tierckpt/run/spare-tickets/offender/2"),
    (keys.ARRIVALS, "tierckpt/run/arrivals"),
    (keys.FINISHED, "tierckpt/run/finished"),
    (keys.FIRST_SEAT_TICKETS, "tierckpt/run/first-seat/tickets"),
    (keys.first_seat(1), "tierckpt/run/first-seat/seat/1"),
    (keys.first_seat_of("h1:/dev/shm/tierckpt"), "tierckpt/run/first-seat/of/h1:/dev/shm/tierckpt"),
    (keys.first_seat_beat(1), "tierckpt/run/first-seat/beat/1"),
    (keys.JOINED, "tierckpt/joined"),
    (keys.counter_done(keys.JOINED), "tierckpt/joined/done"),
    (keys.rank_claim(3), "tierckpt/rank-claim/3"),
    (keys.rank_known("ab12"), "tierckpt/rank-known/ab12"),
    (keys.rank_known_count("ab12"), "tierckpt/rank-known/ab12/n"),
    (keys.rank_decided(3), "tierckpt/rank/3"),
    (keys.RANK_MEMBERS, "tierckpt/rank-members"),
    (keys.RANK_DECIDED, "tierckpt/rank-decided"),
]


@pytest.mark.parametrize(("got", "want"), PINNED, ids=[want for _, want in PINNED])
def test_every_key_keeps_its_value(got: str, want: str) -> None:
    assert got == want


def test_every_key_is_pinned() -> None:
    """A key added to keys.py gets a pin above: a constant by its value, a function by a call."""
    functions = {name for name, value in vars(keys).items() if inspect.isfunction(value)}
    constants = {name for name, value in vars(keys).items() if isinstance(value, str) and name.isupper() and not name.startswith("_")}
    assert sorted(functions | constants) == sorted(keys.__all__)
    assert {getattr(keys, name) for name in constants} <= {got for got, _ in PINNED}
    source = Path(__file__).read_text()
    assert [name for name in sorted(functions) if f"keys.{name}(" not in source] == []


def test_peek_reads_without_blocking_or_writing(server: Any) -> None:
    assert peek(server, keys.NODES) is None
    assert not server.check([keys.NODES])  # the read wrote nothing
    server.set(keys.NODES, b"2")
    assert peek(client(server), keys.NODES) == b"2"
    server.set(keys.AVOID, ABSENT[1:])  # a value that merely resembles the sentinel is a value
    assert peek(server, keys.AVOID) == ABSENT[1:]


def test_a_wait_past_its_timeout_raises_timeout_error(server: Any) -> None:
    with pytest.raises(timeout_error()):
        server.wait([keys.master(0)], datetime.timedelta(seconds=0.05))


def test_a_dead_store_raises_store_errors() -> None:
    """What the agent, its liveness thread and the busy board catch is what a client of a store
    whose host died raises, on every call they make (``set`` has no reply: it may not notice)."""
    code = ("import sys, time, torch.distributed as d\n"
            "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
            "print(s.port, flush=True)\n"
            "time.sleep(60)\n")
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) as host:
        try:
            assert host.stdout is not None
            port = int(host.stdout.readline())
            store = connect_client("127.0.0.1", port, timeout_s=2.0)
            store.set(keys.NODES, b"1")
        finally:
            host.kill()
    calls = {
        "get": lambda: store.get(keys.NODES),
        "add": lambda: store.add(keys.ARRIVALS, 1),
        "peek": lambda: peek(store, keys.NODES),
        "check": lambda: store.check([keys.NODES]),
        "multi_get": lambda: store.multi_get([keys.NODES]),
        "wait": lambda: store.wait([keys.master(0)], datetime.timedelta(seconds=1)),
        "connect": lambda: connect_client("127.0.0.1", port, timeout_s=0.5),
    }
    for name, call in calls.items():
        with pytest.raises(store_errors()):
            call()
            pytest.fail(f"{name} on a dead store returned")
