"""``membership/rounds.Rounds``, one agent's side of every membership round, on a real in-memory
store (``torch.distributed.HashStore``, shared by threads that play the nodes): no agent, no torch round."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tierckpt.launcher.control import keys
from tierckpt.launcher.control.jobcontrol import JobControl
from tierckpt.launcher.events import Events
from tierckpt.launcher.membership import ranks
from tierckpt.launcher.membership.change import Elastic
from tierckpt.launcher.membership.rounds import Round, Rounds
from tierckpt.launcher.options import RunOptions

_EVENTS: list[Events] = []


@pytest.fixture(autouse=True)
def _close_events() -> Iterator[None]:
    yield
    while _EVENTS:
        _EVENTS.pop().close()


def _rounds(tmp: Path, name: str, **opts: Any) -> Rounds:
    events = Events(str(tmp / f"{name}.jsonl"), node=0, host="h")
    _EVENTS.append(events)
    return Rounds(RunOptions(memory_dir=str(tmp / name), node_timeout_s=2.0, **opts), events)


def _events(tmp: Path, name: str) -> list[dict[str, Any]]:
    for e in _EVENTS:
        e.close()
    path = tmp / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _assign_all(store: Any, rounds: list[Rounds], order: list[int]) -> list[int]:
    """Every node's ``assign`` at once (torch's arrival order ``order``), as in one torch round."""
    out: list[int] = [-1] * len(rounds)

    def one(i: int) -> None:
        out[i] = rounds[i].assign(store, order[i], len(rounds), "job")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(rounds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_a_node_keeps_its_rank_across_rounds_whatever_torch_s_order(tmp_path: Path) -> None:
    a, b = _rounds(tmp_path, "a"), _rounds(tmp_path, "b")
    store = dist.HashStore()
    first = _assign_all(dist.PrefixStore("r1/", store), [a, b], [0, 1])
    assert first == [0, 1]
    rs = [r.settled(store, generation=0, node=n, nnodes=2, run_id="job", spare_since=None, via="rendezvous")
          for r, n in zip((a, b), first, strict=True)]
    assert rs[0] == Round(generation=0, node=0, nnodes=2, change=rs[0].change, via="rendezvous")
    assert a.held_rank == 0 and ranks.load_prior(str(tmp_path / "b"), "job") == 1
    # the next round torch orders them the other way round: each keeps its own rank
    again = _assign_all(dist.PrefixStore("r2/", store), [a, b], [1, 0])
    assert again == [0, 1] and a.members == b.members and len(a.members) == 2


def test_settled_reports_the_membership_once_and_remembers_a_scale_down(tmp_path: Path) -> None:
    r = _rounds(tmp_path, "a", elastic=Elastic(1, 3))
    store = dist.HashStore()
    r.members = {0: "x", 1: "y"}
    r.held_rank = 0
    _assign_all(dist.PrefixStore("r/", store), [r], [0])  # a survivor alone now: y left
    got = r.settled(store, generation=4, node=0, nnodes=1, run_id="job", spare_since=None, via="rendezvous")
    assert got.change.left and got.nnodes == 1
    again = r.settled(store, generation=5, node=0, nnodes=1, run_id="job", spare_since=None, via="rendezvous")
    assert not again.change, "a change is reported by the round that made it, not again"
    assert r.snoozed(float("inf")) is False  # the snooze ends; right after the scale-down it may hold
    membership = [e for e in _events(tmp_path, "a") if e.get("event") == "membership"]
    assert len(membership) == 1 and membership[0]["generation"] == 4


def test_an_arrival_below_max_is_seen_once_the_round_settled(tmp_path: Path) -> None:
    r = _rounds(tmp_path, "a", elastic=Elastic(1, 2))
    store = dist.HashStore()
    r.settled(store, generation=0, node=0, nnodes=1, run_id="job", spare_since=None, via="rendezvous")
    assert not r.arrived(store, 1)
    store.add(keys.ARRIVALS, 1)  # a spare passed the gate
    assert r.arrived(store, 1)
    assert not r.arrived(store, 2), "a job on its maximum takes no arrival"
    assert not _rounds(tmp_path, "b").arrived(store, 1), "a job that is not elastic takes none"


def test_lost_nodes_come_from_the_claim_or_the_verdict(tmp_path: Path) -> None:
    r = _rounds(tmp_path, "a")
    assert r.lost_nodes({"reason": "LostNode", "node": 2, "lost": [1, 2]}, None) == [1, 2]
    assert r.lost_nodes({"reason": "LostNode", "node": 2}, None) == [2]
    calls = iter([[], [], [3]])
    assert r.lost_nodes({"reason": "Crash", "node": 0}, lambda: next(calls)) == [3]
    assert r.lost_nodes({"reason": "Crash", "node": 0}, None) == []


def test_the_survivors_regroup_without_a_round(tmp_path: Path) -> None:
    """Nodes 0 and 2 of three survive node 1: each regroups through the store to ranks 0 and 1."""
    store = dist.HashStore()
    got: dict[int, tuple[bool, tuple[int, int] | None]] = {}
    rounds = {n: _rounds(tmp_path, f"n{n}", elastic=Elastic(1, 3)) for n in (0, 2)}
    for r in rounds.values():
        r.members = {0: "id0", 1: "id1", 2: "id2"}

    def one(n: int) -> None:
        seen: list[tuple[int, int]] = []
        ok = rounds[n].regroup({"reason": "LostNode", "node": 1, "lost": [1]}, 7, ctl=JobControl(store), node=n,
                               nnodes=3, waiting=0, lost=None, assign=lambda _s, rank, world: seen.append((rank, world)))
        got[n] = (ok, seen[0] if seen else None)

    threads = [threading.Thread(target=one, args=(n,)) for n in rounds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == {0: (True, (0, 2)), 2: (True, (1, 2))}
    assert rounds[2].members == {0: "id0", 1: "id2"}
    r = rounds[0].settled(store, generation=8, node=0, nnodes=2, run_id="job", spare_since=None, via="regroup")
    assert r.change.left == ["id1"] and r.via == "regroup"


def test_no_regroup_for_a_job_that_is_not_elastic_or_a_membership_change(tmp_path: Path) -> None:
    store = dist.HashStore()
    fixed = _rounds(tmp_path, "a")
    assert not fixed.regroup({"reason": "LostNode", "node": 1}, 0, ctl=JobControl(store), node=0, nnodes=2,
                             waiting=0, lost=None, assign=lambda *_: pytest.fail("no assignment"))
    el = _rounds(tmp_path, "b", elastic=Elastic(1, 2))
    assert not el.regroup({"reason": "MembershipChange", "node": 1}, 0, ctl=JobControl(store), node=0, nnodes=2,
                          waiting=0, lost=None, assign=lambda *_: pytest.fail("no assignment"))


def test_a_survivor_never_waits_at_the_spare_gate_and_forget_makes_it_a_newcomer(tmp_path: Path) -> None:
    r = _rounds(tmp_path, "a")
    r.held_rank = 1
    assert r.gate(object(), ready=lambda: True, generation=0, load_avoid=tuple) is None
    r.forget()
    assert r.held_rank is None
    # a handler without a store or a maximum (not torch's c10d one) has no gate either
    assert r.gate(object(), ready=lambda: True, generation=0, load_avoid=tuple) is None


def test_a_member_that_died_after_it_arrived_breaks_the_round_and_the_others_form_the_next(tmp_path: Path) -> None:
    """Three nodes arrive in a round of tierckpt's handler (min 2, max 3); the third dies before
    it claims its rank. The two others do not wait for the join barrier's 600 s: the round is
    broken (``ranks.RoundBroken``), each says so in a ``warning`` and joins the next round, which
    forms without the dead node. A real TCPStore: the handler blocks in its ``wait``."""
    from tierckpt.launcher.membership.rdzv import TierckptRendezvousHandler

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]

    def handler() -> TierckptRendezvousHandler:
        c = dist.TCPStore("127.0.0.1", server.port, is_master=False)  # type: ignore[attr-defined]
        return TierckptRendezvousHandler(c, "job", min_nodes=2, max_nodes=3, last_call_s=0.3, lead_stale_s=0.5)

    handlers = [handler() for _ in range(3)]
    rounds = [_rounds(tmp_path, f"n{i}") for i in range(2)]
    for r in rounds:
        r.claims_timeout_s = 0.5
    out: list[Any] = [None] * 3

    def live(i: int) -> None:
        def one_round() -> None:
            info = handlers[i].next_rendezvous()
            out[i] = (rounds[i].assign(info.store, info.rank, info.world_size, "job"), info.world_size)
        try:
            rounds[i].rendezvous(one_round, generation=0)
        except Exception as exc:  # the test reads it
            out[i] = exc

    def dead() -> None:
        out[2] = handlers[2].next_rendezvous().world_size  # arrived, in the round, then gone: no claim

    threads = [threading.Thread(target=live, args=(0,)), threading.Thread(target=live, args=(1,)),
               threading.Thread(target=dead)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out[2] == 3, out  # the round closed with the three of them
    assert sorted(out[:2]) == [(0, 2), (1, 2)], out  # the next round: the two live nodes, ranks 0 and 1
    for i in range(2):
        warnings = [e for e in _events(tmp_path, f"n{i}") if e["event"] == "warning"]
        assert len(warnings) == 1 and "round broken" in warnings[0]["what"], warnings
        assert "joining the next round" in warnings[0]["what"]


def test_the_survivors_wait_for_a_replacement_before_they_shrink(tmp_path: Path) -> None:
    """faultyScaleDownTimeoutInSeconds (``Elastic.scale_down_wait_s``): node 2 of 3 is lost with no
    spare waiting; a node that arrives within the wait takes its place through the round (no
    regroup, a ``scale_down`` event ``replaced``); without one the survivors shrink at its end."""
    store = dist.HashStore()  # type: ignore[attr-defined]
    fault = {"reason": "LostNode", "node": 2, "lost": [2]}
    r = _rounds(tmp_path, "a", elastic=Elastic(1, 3, (), 0.6))
    arrived = threading.Timer(0.3, lambda: box.append(1))
    box: list[int] = []
    arrived.start()
    t0 = time.monotonic()
    assert not r.regroup(fault, 4, ctl=JobControl(store), node=0, nnodes=3, waiting=lambda: len(box), lost=None,
                         assign=lambda *_: pytest.fail("no regroup: the replacement takes the round"))
    assert 0.3 <= time.monotonic() - t0 < 0.6 + 0.5
    ev = [e for e in _events(tmp_path, "a") if e["event"] == "scale_down"]
    assert ev and ev[0]["state"] == "replaced" and ev[0]["wait_s"] == 0.6, ev


def test_assign_gives_the_rank_and_the_memberships_are_read_once_the_round_settled(tmp_path: Path) -> None:
    """``assign`` returns the rank without reading the round's memberships (O(N) for a node that
    was no survivor); ``settled`` reads them and reports the round as before; a survivor then
    claims with the digest the decision gave, and ``members_known`` never reads the store."""
    a, b = _rounds(tmp_path, "a"), _rounds(tmp_path, "b")
    store = dist.HashStore()
    first = _assign_all(dist.PrefixStore("r1/", store), [a, b], [0, 1])
    assert first == [0, 1] and a.members_known == {} and a._decided is not None
    for r, n in zip((a, b), first, strict=True):
        r.settled(store, generation=0, node=n, nnodes=2, run_id="job", spare_since=None, via="rendezvous")
    assert a.members_known == b.members == {0: ranks.identity(str(tmp_path / "a")), 1: ranks.identity(str(tmp_path / "b"))}
    assert a._digest == ranks.members_digest(a.members)
    c = _rounds(tmp_path, "c")  # b is lost, c takes its rank
    _assign_all(dist.PrefixStore("r2/", store), [c, a], [0, 1])
    got = a.settled(store, generation=1, node=0, nnodes=2, run_id="job", spare_since=None, via="rendezvous")
    assert got.change.replaced == [{"node": 1, "left": ranks.identity(str(tmp_path / "b")),
                                    "by": ranks.identity(str(tmp_path / "c"))}]
    assert c.members == a.members  # c, a newcomer, read them on first use


def test_over_our_handler_the_round_decides_the_stable_rank_and_assign_exchanges_nothing(tmp_path: Path) -> None:
    """``gate`` gives tierckpt's handler this node's claim: the round's leader decides the stable
    ranks (no claim is exchanged after it: ``exchange_round`` is not called), ``assign`` returns
    the round's decision, and the next round keeps each node's rank whatever the host order."""
    from tierckpt.launcher.membership.rdzv import TierckptRendezvousHandler

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    hs = [TierckptRendezvousHandler(dist.TCPStore("127.0.0.1", server.port, is_master=False),  # type: ignore[attr-defined]
                                    "job", min_nodes=2, max_nodes=2) for _ in range(2)]
    rs = [_rounds(tmp_path, f"n{i}") for i in range(2)]
    for r, h in zip(rs, hs, strict=True):
        r.held_rank = 0  # a survivor never waits at the spare gate (no seats in this test) ...
        assert r.gate(h, ready=lambda: True, generation=0, load_avoid=tuple) is None and h.claim is not None
        r.held_rank = None  # ... and the first round's claims are newcomers' (the claim is built at the arrival)
    real = ranks.exchange_round
    ranks.exchange_round = lambda *a, **k: pytest.fail("no exchange after our round")  # type: ignore[assignment]
    try:
        for gen, hosts in enumerate((("host-a", "host-b"), ("host-z", "host-b"))):
            for h, host in zip(hs, hosts, strict=True):
                h._host = host
            out: list[int] = [-1, -1]

            def one(i: int, gen: int = gen, out: list[int] = out) -> None:
                info = hs[i].next_rendezvous()
                out[i] = rs[i].assign(info.store, info.rank, info.world_size, "job", hs[i])
                rs[i].settled(server, generation=gen, node=out[i], nnodes=2, run_id="job", spare_since=None,
                              via="rendezvous")

            threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert out == [0, 1], (gen, out)  # the second round: host-z sorts last, and keeps rank 0
    finally:
        ranks.exchange_round = real  # type: ignore[assignment]
    assert rs[0].members == {0: ranks.identity(str(tmp_path / "n0")), 1: ranks.identity(str(tmp_path / "n1"))}
