"""The rank exchange of a rendezvous round (membership/ranks.py ``exchange_round``) on a real
TCPStore, one thread and one client per node: every node gets the same memberships, survivors keep
their ranks, a spare takes the lost node's, and neither a node's store traffic nor its work before
it has its rank grows with the job (torch rank 0 decides and names the new membership by digest; a
survivor reads only what changed; any other node reads the memberships when it asks for them)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tierckpt.errors import ProtocolError
from tierckpt.launcher.control import store as store_mod
from tierckpt.launcher.membership import ranks
from tierckpt.launcher.membership.ranks import Claim, RoundBroken

from .conftest import client


class _Metered:
    """One node's client: its round trips and the bytes it read back (``ranked``: both when the
    node had its rank, before it asked for the memberships)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.ops, self.read = inner, 0, 0
        self.ranked = (0, 0)

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.inner, name)

        def call(*a: Any) -> Any:
            self.ops += 1
            got = fn(*a)
            if name == "get":
                self.read += len(got)
            elif name == "multi_get":
                self.read += sum(len(v) for v in got)
            return got
        return call


def _round(server: Any, prefix: str, claims: list[Claim], timeout: float = 20.0,
           clients: list[Any] | None = None, only: int | None = None,
           decided: list[Any] | None = None) -> tuple[list[Any], list[_Metered]]:
    """Every claim exchanged at once on the round's store, claim i as torch rank i; (rank,
    before, after) per node (``Decided.memberships`` asked right after), or its error; ``only``:
    the first that many nodes take part (the others arrived in the round and died); ``decided``:
    filled with each node's ``Decided``."""
    clients = clients or [client(server) for _ in claims]
    stores = [_Metered(_prefixed(c, prefix)) for c in clients]
    out: list[Any] = [None] * len(claims)
    got: list[Any] = decided if decided is not None else []
    got[:] = [None] * len(claims)
    taking_part = len(claims) if only is None else only

    def node(i: int) -> None:
        try:
            got[i] = ranks.exchange_round(stores[i], i, len(claims), claims[i], timeout=timeout)
            stores[i].ranked = (stores[i].ops, stores[i].read)
            out[i] = (got[i].rank, *got[i].memberships())
        except Exception as exc:  # the test reads it
            out[i] = exc

    threads = [threading.Thread(target=node, args=(i,)) for i in range(taking_part)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return out, stores


def _prefixed(server: Any, name: str) -> Any:
    import torch.distributed as dist

    return dist.PrefixStore(name, server)  # type: ignore[attr-defined]


def _identities(n: int) -> list[str]:
    return [f"host{i:04d}.cluster.example:/dev/shm/tierckpt" for i in range(n)]


def test_a_spare_takes_the_lost_nodes_rank_and_every_node_sees_the_same_change(server: Any) -> None:
    ids = _identities(4)
    first, _ = _round(server, "r0/", [Claim(prior=None, identity=i) for i in reversed(ids)])
    members = first[0][2]
    assert [r for r, _, _ in first] == [0, 1, 2, 3] and members == dict(enumerate(reversed(ids)))
    assert all(got == (r, {}, members) for r, got in enumerate(first))  # no previous round
    # node with rank 2 is lost; torch orders the spare first and the survivors after it
    held = {ident: rank for rank, ident in members.items()}
    survivors = [i for i in ids if held[i] != 2]
    claims = [Claim(prior=None, identity="spare:/dev/shm/tierckpt")] + [
        Claim(prior=held[i], survivor=True, identity=i, members=members) for i in survivors]
    second, _ = _round(server, "r1/", claims)
    assert [r for r, _, _ in second] == [2] + [held[i] for i in survivors]
    after = {**members, 2: "spare:/dev/shm/tierckpt"}
    assert all(b == members and a == after for _, b, a in second)


def test_store_traffic_per_node_does_not_grow_with_the_job(server: Any) -> None:
    """At 6 and at 16 nodes a survivor makes the same few round trips and reads the same bytes
    (the difference), torch rank 0 reads every claim in one multi_get; a newcomer reads the whole
    membership once, compressed."""
    seen: dict[int, tuple[int, int, int, int]] = {}
    clients = [client(server) for _ in range(16)]
    for n in (6, 16):
        ids = _identities(n)
        members = dict(enumerate(ids))
        claims = [Claim(prior=r, survivor=True, identity=ids[r], members=members) for r in range(n - 1)]
        claims.append(Claim(prior=None, identity="spare:/dev/shm/tierckpt"))  # rank n-1's node was lost
        got, stores = _round(server, f"n{n}/", claims, clients=clients[:n])
        assert [r for r, _, _ in got] == list(range(n))
        assert all(a == {**members, n - 1: "spare:/dev/shm/tierckpt"} for _, _, a in got)
        survivor_ops = max(s.ops for s in stores[1:-1])
        survivor_read = max(s.read for s in stores[1:-1])
        seen[n] = (survivor_ops, survivor_read, stores[0].ops, stores[-1].read)
    assert seen[6][0] <= 5 and seen[16][0] <= 5, seen  # add, set, wait, multi_get (the first to know the map: +1 set)
    assert seen[16][1] <= seen[6][1] + 8, seen  # the rank's digits may grow; the difference does not
    assert seen[16][2] <= seen[6][2], seen  # the decider's round trips do not grow either
    raw_map = sum(len(f'"{r}":"{i}",') for r, i in enumerate(_identities(16)))
    assert seen[16][3] < raw_map, seen  # the spare's copy of two memberships, compressed


def test_survivors_with_different_views_are_merged(server: Any) -> None:
    a, b = {0: "a", 1: "b", 2: "c"}, {0: "a", 1: "b", 2: "stale"}
    claims = [Claim(prior=0, survivor=True, identity="a", members=a),
              Claim(prior=1, survivor=True, identity="b", members=b),
              Claim(prior=None, identity="d")]
    got, _ = _round(server, "m/", claims)
    assert [r for r, _, _ in got] == [0, 1, 2]
    before = {**a, **b}  # merged in torch-rank order, as the claims arrive in the decision
    assert all((bf, af) == (before, {0: "a", 1: "b", 2: "d"}) for _, bf, af in got)


def test_a_member_that_never_claims_breaks_the_round_for_every_member(server: Any) -> None:
    """Torch rank 2 arrived and died before it claimed: torch rank 0 waits its timeout, publishes
    the round broken (naming the missing rank), and both live members raise ``RoundBroken`` at once
    (they join the next round), not a wait for the join barrier's 600 s."""
    claims = [Claim(prior=None, identity="a"), Claim(prior=None, identity="b")]
    t0 = time.monotonic()
    got, _ = _round(server, "broken/", claims + [Claim(prior=None, identity="dead")], timeout=0.5,
                    clients=None, only=2)
    assert all(isinstance(g, RoundBroken) for g in got[:2]), got
    assert "torch rank(s) [2] of 3" in str(got[1]), got
    assert time.monotonic() - t0 < 5.0
    assert issubclass(RoundBroken, ProtocolError)


def test_a_round_whose_first_node_never_decides_is_broken_too(server: Any) -> None:
    """Named as every broken round is ("round broken: ..."): the launcher's warning says so whichever
    member died (test_rounds' dead member, when it arrived first, was torch rank 0: a flake)."""
    store = _prefixed(server, "x/")
    with pytest.raises(RoundBroken, match="^round broken: .*torch rank 0"):
        ranks.exchange_round(_prefixed(client(server), "x/"), 1, 2, Claim(prior=None), timeout=0.5)
    assert store.check(["tierckpt/rank-claim/1"])  # its claim was published all the same


def test_a_claim_on_the_wire_names_the_map_by_digest() -> None:
    c = Claim(prior=1, survivor=True, identity="h:/m", members={0: "x", 1: "h:/m"})
    wire = Claim.from_json(c.to_json())
    assert wire.members is None and wire.digest == ranks.members_digest({1: "h:/m", 0: "x"})
    assert (wire.prior, wire.survivor, wire.identity) == (1, True, "h:/m")
    assert Claim.from_json(b'{"prior": 0}') == Claim(prior=0)  # an older agent's claim
    old = Claim.from_json(b'{"prior": 0, "survivor": true, "members": {"0": "a"}}')
    assert old.members == {0: "a"}  # an older agent sent its map inline: still read


def test_a_node_has_its_rank_without_reading_or_hashing_a_whole_membership(server: Any, monkeypatch: Any) -> None:
    """The work before a node has its rank does not grow with the job: only torch rank 0 hashes a
    membership (once: the new one's digest, in the decision), a survivor claims with the digest it
    was told, and no node but torch rank 0 reads more than the decision and its rank; a node that
    was not a survivor reads the memberships (one get) when it asks for them, a survivor reads
    nothing more."""
    hashed: list[str] = []
    real_digest = ranks.members_digest
    monkeypatch.setattr(ranks, "members_digest", lambda m: hashed.append(threading.current_thread().name)
                        or real_digest(m))
    seen: dict[int, tuple[int, int, int, int]] = {}
    clients = [client(server) for _ in range(24)]
    for n in (6, 24):
        ids = _identities(n)
        decided: list[Any] = []
        first, stores = _round(server, f"first{n}/", [Claim(prior=None, identity=i) for i in ids],
                               clients=clients[:n], decided=decided)
        members = first[0][2]
        assert all(d.digest == real_digest(members) for d in decided), "the decision names the new membership"
        newcomer = max(s.ranked[1] for s in stores[1:])
        assert all(s.ranked[0] == 3 for s in stores[1:]), "set the claim, wait, one multi_get"
        assert all(s.ops - s.ranked[0] == 1 for s in stores), "a newcomer's memberships: one get, when asked"
        hashed.clear()
        survivors = [Claim(prior=r, survivor=True, identity=ids[r], members=members, digest=decided[r].digest)
                     for r in range(n - 1)]
        second, stores = _round(server, f"second{n}/", [*survivors, Claim(prior=None, identity="spare:/m")],
                                clients=clients[:n])
        assert [r for r, _, _ in second] == list(range(n)) and all(b == members for _, b, _ in second)
        assert len(hashed) == 1, f"only torch rank 0 hashes, once: {hashed}"
        assert all(s.ops == s.ranked[0] for s in stores[1:-1]), "a survivor on the base: no read to ask"
        seen[n] = (newcomer, max(s.ranked[1] for s in stores[1:]), stores[0].ranked[0], max(s.ranked[0] for s in stores))
    assert seen[24][0] <= seen[6][0] + 8 and seen[24][1] <= seen[6][1] + 8, seen  # bytes to the rank: flat
    assert seen[24][2] <= seen[6][2] and seen[24][3] <= seen[6][3], seen  # round trips to the rank: flat


def test_survivors_naming_one_map_count_once_at_their_last_place() -> None:
    """torch rank 0 merges each distinct map once (O(N), not O(N) per survivor), with the result of
    merging every survivor's map in torch-rank order."""
    a, b = {0: "a", 1: "b", 2: "c"}, {0: "a", 1: "x", 3: "d"}
    claims = [Claim(prior=0, survivor=True, digest="A"), Claim(prior=1, survivor=True, digest="B"),
              Claim(prior=None), Claim(prior=2, survivor=True, digest="A")]
    assert ranks._merged(claims, {"A": a, "B": b}) == {**a, **b, **a}
    inline = Claim(prior=3, survivor=True, members={1: "y"})  # an older agent's map, inline
    assert ranks._merged([*claims, inline], {"A": a, "B": b}) == {**a, **b, **a, 1: "y"}


def test_the_decider_reads_the_claims_in_parts(server: Any, monkeypatch: Any) -> None:
    """Torch rank 0 waits for and reads the claims ``store.KEYS_PER_CALL`` keys a call (3 here, 10 nodes:
    4 parts): the spare still takes the lost rank and every survivor keeps its own; a claim missing
    from the last part breaks the round at torch rank 0's deadline, naming it."""
    ids = _identities(10)
    members = dict(enumerate(ids))
    claims = [Claim(prior=None, identity="spare:/dev/shm/tierckpt")] + [
        Claim(prior=r, survivor=True, identity=ids[r], members=members) for r in range(10) if r != 4]
    _, whole = _round(server, "whole/", claims)  # one part of 512
    monkeypatch.setattr(store_mod, "KEYS_PER_CALL", 3)
    got, stores = _round(server, "parts/", claims)
    assert [r for r, _, _ in got] == [4, 0, 1, 2, 3, 5, 6, 7, 8, 9], got
    assert stores[0].ops - whole[0].ops == 2 * (4 - 1), (stores[0].ops, whole[0].ops)  # a wait and a read a part
    assert sorted(s.ops for s in stores[1:]) == sorted(s.ops for s in whole[1:])  # the others: as before
    clients = [client(server) for _ in range(10)]  # connected first: a connect's DNS lookup can take 5 s here
    t0 = time.monotonic()
    broken, _ = _round(server, "parts-broken/", [Claim(prior=None, identity=f"n{i}") for i in range(10)],
                       timeout=0.6, clients=clients, only=9)  # torch rank 9 (the last part) arrived and died
    assert all(isinstance(g, RoundBroken) for g in broken[:9]), broken
    assert "torch rank(s) [9] of 10" in str(broken[0]), broken
    assert time.monotonic() - t0 < 4.0  # rank 0's deadline (0.6 s), not the members' own (5.6 s)
