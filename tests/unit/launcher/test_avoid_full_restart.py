"""Repeat offenders at full job restarts (``avoid.py``, ``offenders.py``, ``spares.SpareGate``) on a
real TCPStore on 127.0.0.1: the agreed avoid list (no spare cap), the scheduler's hint file, and a
relaunched offender that leaves the first round's seats to another node (or takes a free one
after its wait, so the job never starts short)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.unit.launcher.conftest import client as _client
from tierckpt.errors import ConfigError
from tierckpt.launcher.decide.offenders import NodeFault, OffenderPolicy
from tierckpt.launcher.membership import seats as seats_mod
from tierckpt.launcher.membership.avoid import (
    Avoided,
    AvoidSettings,
    RepeatOffenders,
    agree_avoid,
    avoided,
    publish_machine,
    write_avoid_file,
)
from tierckpt.launcher.membership.seats import FirstSeats
from tierckpt.launcher.membership.spares import SpareGate, open_seats, publish_nodes

MEMBERS = {0: "h0:/m0", 1: "h1:/m1"}


def _claim(g: int, node: int, t: float) -> dict[str, Any]:
    return {"generation": g, "time": t, "reason": "Crash", "node": node}


def test_a_full_restart_avoids_the_offender_without_a_spare_on_every_agent(server: Any) -> None:
    """Node 1 faults twice; no spare waits (a process restart would keep nobody out), yet the
    full restart's list names it, with the machine name its agent published, on both agents."""
    policy = OffenderPolicy(max_avoid=1, window_s=3600.0)
    a, b = RepeatOffenders(policy), RepeatOffenders(policy)
    sa, sb = _client(server), _client(server)
    publish_machine(sa, "h1:/m1", "gpu-node-17")
    for g, t in ((0, 10.0), (1, 20.0)):
        a.record(sa, g, _claim(g, 1, t), MEMBERS)
        b.record(sb, g, _claim(g, 1, t), MEMBERS)
    assert a.keep_out(sa, 1, _claim(1, 1, 20.0), MEMBERS, spares=0).ranks == ()  # a process restart: no spare, no one
    first = a.at_full_restart(sa, 1)
    second = b.at_full_restart(sb, 1)
    assert first == second == [Avoided("h1:/m1", "gpu-node-17", 2)]
    # only the worst max_avoid: node 0 faults twice too, node 1 three times
    for g, node, t in ((2, 0, 30.0), (3, 0, 31.0), (4, 1, 32.0)):
        a.record(sa, g, _claim(g, node, t), MEMBERS)
    assert a.at_full_restart(sa, 4) == [Avoided("h1:/m1", "gpu-node-17", 3)]
    both = RepeatOffenders(OffenderPolicy(max_avoid=2, window_s=3600.0))
    both.remember(_client(server), a.remembered)
    got = both.at_full_restart(_client(server), 5)
    assert [(x.identity, x.machine, x.faults) for x in got] == [("h1:/m1", "gpu-node-17", 3), ("h0:/m0", "h0", 2)]
    assert RepeatOffenders(OffenderPolicy(max_avoid=0)).at_full_restart(sa, 6) == []


def test_without_the_store_an_agent_answers_from_what_it_read() -> None:
    class Gone:
        def compare_set(self, *_: Any) -> bytes:
            raise RuntimeError("Connection reset by peer")  # what torch's DistError is

    avoid = RepeatOffenders(OffenderPolicy(max_avoid=1))
    avoid.remembered = {"0": {"identity": "h1:/m1", "time": 1.0}, "1": {"identity": "h1:/m1", "time": 2.0}}
    assert avoid.at_full_restart(Gone(), 1) == [Avoided("h1:/m1", "h1", 2)]


def test_the_policy_caps_a_full_restarts_list_by_max_avoid_only() -> None:
    faults = [NodeFault(i, t) for i, t in (("a", 1.0), ("a", 2.0), ("b", 3.0), ("b", 4.0), ("c", 5.0))]
    assert OffenderPolicy(max_avoid=1).avoid_at_full_restart(faults) == ["b"]  # as many faults: the newest first
    assert OffenderPolicy(max_avoid=5).avoid_at_full_restart(faults) == ["b", "a"]
    assert OffenderPolicy(max_avoid=5).exclude(faults, spares=0) == []  # a process restart needs spares
    assert OffenderPolicy(max_avoid=5, window_s=1.5).avoid_at_full_restart(faults) == []


def test_the_hint_file_is_one_machine_a_line_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "hints" / "avoid"
    write_avoid_file(str(path), [Avoided("h1:/m1", "gpu-17", 2), Avoided("h1:/m2", "gpu-17", 2),
                                 Avoided("h3:/m", "gpu-3", 2)])
    assert path.read_text() == "gpu-17\ngpu-3\n"
    write_avoid_file(str(path), [])  # the next full restart avoids nobody: a stale list must not stay
    assert path.read_text() == ""
    assert sorted(p.name for p in path.parent.iterdir()) == ["avoid"]  # no temporary file left


def test_an_agent_without_the_list_learns_it_from_the_store(server: Any) -> None:
    """The first agent of the new start publishes its state file's list; one whose state file
    lacks it (a fresh machine) reads it; a node is matched by machine when the scheduler names it."""
    entry = Avoided("pod-1:/dev/shm/tierckpt", "gpu-17", 2)
    assert agree_avoid(_client(server), [entry.to_dict(), {"identity": 3}]) == [entry]  # a damaged entry dropped
    learned = agree_avoid(_client(server), None)
    assert learned == [entry]
    assert avoided(learned, "pod-1:/dev/shm/tierckpt", AvoidSettings()) == entry
    # Kubernetes: the pod keeps its host name on another machine; the machine decides
    assert avoided(learned, "pod-1:/dev/shm/tierckpt", AvoidSettings(machine="gpu-40")) is None
    assert avoided(learned, "pod-7:/dev/shm/tierckpt", AvoidSettings(machine="gpu-17")) == entry


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_settings_are_config_errors(bad: float) -> None:
    with pytest.raises(ConfigError, match="--avoid-wait"):
        AvoidSettings(wait_s=bad)
    with pytest.raises(ConfigError, match="--avoid-file"):
        AvoidSettings(file="")


def _gate(store: Any, identity: str, server: Any, **kw: Any) -> SpareGate:
    seats = FirstSeats(identity, stale_s=30.0, connect=lambda: _client(server))
    return SpareGate(store, 2, lambda _n: None, seats=seats, poll_s=0.02, **kw)


def _in_thread(gate: SpareGate) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def go() -> None:
        try:
            out["since"] = gate.wait()
        except Exception as exc:  # noqa: BLE001 - reported by the assertions
            out["error"] = exc
        finally:
            if gate.beat is not None:
                gate.beat.stop()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, out


def test_a_relaunched_offender_leaves_the_first_seats_to_another_node(server: Any) -> None:
    """A 2-node job after a full restart: node 0 takes seat 0; the offender arrives next, draws no
    seat while another node can come; the spare that arrives after it takes seat 1; once the
    round formed the offender waits at the gate, and takes a seat only when one opens."""
    seats_mod.take(_client(server), "h0:/m0", 2)
    held: list[bool] = []
    offender = _gate(_client(server), "h1:/m1", server, offender=True, hold_s=30.0,
                     on_hold_over=lambda: held.append(True))
    t_off, off = _in_thread(offender)
    time.sleep(0.5)  # the offender is at the gate first
    assert seats_mod.holder(_client(server), 1) is None and t_off.is_alive()
    spare = _gate(_client(server), "h2:/m2", server)
    assert spare.wait() is None  # the spare takes seat 1 at once
    if spare.beat is not None:
        spare.beat.stop()
    assert seats_mod.holder(_client(server), 1) == "h2:/m2"
    publish_nodes(_client(server), 2)  # the round of h0 and h2 formed
    time.sleep(0.5)
    assert t_off.is_alive() and not held, off  # standing by at the gate, no seat
    open_seats(_client(server), 3, 0, 1)  # later a node is lost: no other spare waits, the offender goes
    t_off.join(timeout=10)
    assert not t_off.is_alive() and "error" not in off and off["since"] is not None, off


def test_with_no_other_node_the_offender_takes_the_free_seat_after_its_wait(server: Any) -> None:
    seats_mod.take(_client(server), "h0:/m0", 2)
    held: list[bool] = []
    offender = _gate(_client(server), "h1:/m1", server, offender=True, hold_s=0.5,
                     on_hold_over=lambda: held.append(True))
    t0 = time.monotonic()
    offender.wait()
    took = time.monotonic() - t0
    if offender.beat is not None:
        offender.beat.stop()
    assert held == [True] and took >= 0.5
    assert seats_mod.holder(_client(server), 1) == "h1:/m1"  # the job is not started short
