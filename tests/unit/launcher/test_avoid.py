"""Repeat offenders enforced (``launcher/membership/avoid.py``): attribution and persistence in a real TCPStore
on 127.0.0.1, the agreed keep-out list, and leaving a real c10d rendezvous round."""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import pytest

from tests.unit.launcher.conftest import client as _client
from tierckpt.launcher.decide.offenders import OffenderPolicy
from tierckpt.launcher.membership.avoid import RepeatOffenders
from tierckpt.launcher.membership.change import MEMBERSHIP_CHANGE
from tierckpt.launcher.membership.torch_rdzv import leave_round


def _claim(g: int, node: int | None, t: float, reason: str = "Crash") -> dict[str, Any]:
    return {"generation": g, "time": t, "reason": reason, "node": node}


MEMBERS = {0: "h0:/m0", 1: "h1:/m1"}


def test_two_faults_of_one_node_keep_it_out_on_every_agent(server: Any) -> None:
    """Two agents (own store clients) record the same claims; the second fault of node 1 makes it
    a repeat offender, and both get rank 1 back, even though the second agent reads no spare."""
    policy = OffenderPolicy(max_avoid=1, window_s=3600.0)
    a, b = RepeatOffenders(policy), RepeatOffenders(policy)
    sa, sb = _client(server), _client(server)
    t0 = 1000.0
    assert a.keep_out(sa, 0, _claim(0, 1, t0), MEMBERS, spares=1).ranks == ()
    assert b.keep_out(sb, 0, _claim(0, 1, t0), MEMBERS, spares=1).ranks == ()
    # a membership change is not a fault: still one fault on node 1
    assert a.keep_out(sa, 1, _claim(1, None, t0 + 1, MEMBERSHIP_CHANGE), MEMBERS, spares=1).ranks == ()
    assert b.keep_out(sb, 1, _claim(1, None, t0 + 1, MEMBERSHIP_CHANGE), MEMBERS, spares=1).ranks == ()
    first = a.keep_out(sa, 2, _claim(2, 1, t0 + 2), MEMBERS, spares=1)
    second = b.keep_out(sb, 2, _claim(2, 1, t0 + 2), MEMBERS, spares=0)  # the spare left meanwhile: A's answer holds
    assert first == second
    assert (first.ranks, first.identities, first.spares) == ((1,), ("h1:/m1",), 1)
    assert a.count("h1:/m1") == b.count("h1:/m1") == 2 and a.count("h0:/m0") == 0
    assert sorted(a.remembered) == ["0", "2"] and a.remembered["2"]["identity"] == "h1:/m1"


def test_a_fault_is_the_node_identitys_not_the_ranks(server: Any) -> None:
    """Rank 1 was held by h1 at the first fault and by a spare at the second: nobody has two."""
    avoid = RepeatOffenders(OffenderPolicy(max_avoid=1))
    store = _client(server)
    assert avoid.keep_out(store, 0, _claim(0, 1, 10.0), MEMBERS, spares=1).ranks == ()
    after = {0: "h0:/m0", 1: "spare:/m2"}
    assert avoid.keep_out(store, 1, _claim(1, 1, 20.0), after, spares=1).ranks == ()
    assert {f.identity for f in avoid.faults()} == {"h1:/m1", "spare:/m2"}
    # h1 comes back later at rank 1 (the spare got lost): its second fault counts with the first
    assert avoid.keep_out(store, 2, _claim(2, 1, 30.0), MEMBERS, spares=1).ranks == (1,)


def test_no_spare_no_window_or_off_keeps_nobody_out(server: Any) -> None:
    store = _client(server)
    short = RepeatOffenders(OffenderPolicy(max_avoid=1, window_s=5.0))
    assert short.keep_out(store, 0, _claim(0, 1, 0.0), MEMBERS, spares=1).ranks == ()
    assert short.keep_out(store, 1, _claim(1, 1, 10.0), MEMBERS, spares=1).ranks == ()  # 10 s apart > 5 s window
    nospare = RepeatOffenders(OffenderPolicy(max_avoid=1))
    assert nospare.keep_out(store, 2, _claim(2, 1, 11.0), MEMBERS, spares=0).ranks == ()  # never shrinks the job
    off = RepeatOffenders(OffenderPolicy(max_avoid=0))
    assert off.keep_out(store, 3, _claim(3, 1, 12.0), MEMBERS, spares=3).ranks == ()
    assert not off.enabled and off.remembered == {}


def test_offenses_survive_a_full_job_restart_through_the_state_file(server: Any) -> None:
    """The old store is gone with the job; an agent merges what its state file kept into the new one."""
    import torch.distributed as dist

    policy = OffenderPolicy(max_avoid=1)
    old = RepeatOffenders(policy)
    store = _client(server)
    old.keep_out(store, 0, _claim(0, 1, 10.0), MEMBERS, spares=1)
    kept = dict(old.remembered)  # what _save_state writes
    fresh = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,  # type: ignore[attr-defined]
                          timeout=datetime.timedelta(seconds=10))
    new = RepeatOffenders(policy)
    new.remember(fresh, kept)
    new.remember(fresh, {"9": {"identity": 7}, "x": "junk"})  # a damaged entry is dropped
    assert sorted(new.remembered) == ["0"]
    # after the restart node h1 holds rank 0: its second fault keeps it out
    swapped = {0: "h1:/m1", 1: "h0:/m0"}
    assert new.keep_out(fresh, 4, _claim(4, 0, 20.0), swapped, spares=1).ranks == (0,)


def _handler(store: Any, run_id: str, keep_alive_s: int) -> Any:
    """torch's own c10d rendezvous handler, as ``torchrun --rdzv-backend c10d`` builds it."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    return DynamicRendezvousHandler.from_backend(
        run_id, store, C10dRendezvousBackend(store, run_id), 2, 2, local_addr="127.0.0.1",
        timeout=RendezvousTimeout(join=datetime.timedelta(seconds=60), last_call=datetime.timedelta(seconds=1)),
        keep_alive_interval=keep_alive_s, keep_alive_max_attempt=3)


def _rounds(handlers: list[Any]) -> dict[int, Any]:
    out: dict[int, Any] = {}

    def go(i: int, h: Any) -> None:
        try:
            out[i] = h.next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - reported by the assertion
            out[i] = exc

    threads = [threading.Thread(target=go, args=(i, h), daemon=True) for i, h in enumerate(handlers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def test_leave_round_lets_the_others_form_the_next_round_at_once(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch's c10d handlers A and B form a round with a 20 s keep-alive (a 60 s expiry); B leaves
    it, and A's next round with a newcomer C completes long before B's keep-alive could expire."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as tierckpt run sets it
    a, b, c = (_handler(_client(server), "avoid", 20) for _ in range(3))
    first = _rounds([a, b])
    assert all(not isinstance(v, Exception) for v in first.values()), first
    assert leave_round(b) is True
    t0 = time.monotonic()
    second = _rounds([a, c])
    took = time.monotonic() - t0
    assert all(not isinstance(v, Exception) for v in second.values()), second
    assert sorted(v.world_size for v in second.values()) == [2, 2]
    assert took < 30.0, took  # B's keep-alive would expire only after 60 s
    for h in (a, c):
        h.shutdown()


def test_leave_round_without_torchs_private_parts_reports_false() -> None:
    class Other:
        stopped = False

        def _stop_heartbeats(self) -> None:
            self.stopped = True

    other = Other()
    assert leave_round(object()) is False
    assert leave_round(other) is False and other.stopped  # the keep-alive stops all the same


def test_a_fault_before_a_full_restart_is_recorded_for_the_state_file(server: Any) -> None:
    """``record`` alone (a decision other than a process restart) keeps the offense too."""
    avoid = RepeatOffenders(OffenderPolicy(max_avoid=1))
    store = _client(server)
    avoid.record(store, 0, _claim(0, 1, 5.0), MEMBERS)
    avoid.record(store, 0, _claim(0, 1, 5.0), MEMBERS)  # every agent records the same entry
    assert avoid.remembered == {"0": {"identity": "h1:/m1", "time": 5.0, "reason": "Crash"}}
    other = RepeatOffenders(OffenderPolicy(max_avoid=1))
    assert other.keep_out(_client(server), 1, _claim(1, 1, 6.0), MEMBERS, spares=1).ranks == (1,)
