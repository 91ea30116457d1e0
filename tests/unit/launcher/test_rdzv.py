"""``--rdzv-backend tierckpt`` (membership/rdzv.py) on a real TCPStore on 127.0.0.1, threads playing
the nodes (each with its own client, as each agent has); torch's registry builds it from the same
parameters as ``tierckpt run`` gives it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

from tierckpt.launcher.membership import torch_rdzv
from tierckpt.launcher.membership.rdzv import BACKEND, TierckptRendezvousHandler, register


@pytest.fixture
def server() -> Iterator[Any]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    yield store
    del store


def _client(server: Any) -> Any:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)


def _handler(server: Any, *, run: str = "job", **kw: Any) -> TierckptRendezvousHandler:
    kw.setdefault("min_nodes", 2)
    kw.setdefault("max_nodes", 2)
    kw.setdefault("last_call_s", 0.2)
    kw.setdefault("lead_stale_s", 0.3)
    return TierckptRendezvousHandler(_client(server), run, **kw)


def _all(handlers: list[TierckptRendezvousHandler], *, stagger: float = 0.0) -> list[Any]:
    """Every handler's ``next_rendezvous`` at once (each in its thread); (rank, world) or the error."""
    out: list[Any] = [None] * len(handlers)

    def one(i: int) -> None:
        time.sleep(stagger * i)
        try:
            info = handlers[i].next_rendezvous()
            out[i] = (info.rank, info.world_size)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_a_first_round_gives_each_node_a_rank_at_once(server: Any) -> None:
    hs = [_handler(server, min_nodes=4, max_nodes=4) for _ in range(4)]
    t0 = time.monotonic()
    got = _all(hs)
    took = time.monotonic() - t0
    assert sorted(got) == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert took < 5, "a round at max_nodes closes when the last node arrives, no last call"
    assert all(h.num_nodes_waiting() == 0 for h in hs)


def test_on_the_legacy_store_server_the_members_wake_when_the_round_closes() -> None:
    """torch's legacy TCPStore server (use_libuv=False, the one bench scale and bench rdzv host) wakes
    no waiter on a ``compare_set``: before the leader also ``set`` the world key, every member saw the
    close only when its 1 s wait ran out (64 nodes: 1 s for most, 6 s for some)."""
    legacy = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=False)
    hs = [_handler(legacy, min_nodes=3, max_nodes=3) for _ in range(3)]
    done: list[float] = []

    def one(i: int) -> None:
        hs[i].next_rendezvous()
        done.append(time.monotonic())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(done) == 3
    assert max(done) - t0 < 0.9, "a member waited out its 1 s wait: the close did not wake it"
    del legacy


def test_the_round_store_is_one_per_round_and_shared_by_its_members(server: Any) -> None:
    hs = [_handler(server) for _ in range(2)]
    infos: list[Any] = [None, None]

    def one(i: int) -> None:
        infos[i] = hs[i].next_rendezvous()

    threads = [threading.Thread(target=one, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    infos[0].store.set("x", b"from-round-0")
    assert infos[1].store.get("x") == b"from-round-0"
    assert not server.check(["x"]), "the round's keys live under its own prefix"


def test_below_max_the_round_closes_after_the_last_call_and_a_late_node_waits_for_the_next(server: Any) -> None:
    hs = [_handler(server, min_nodes=1, max_nodes=3) for _ in range(2)]
    assert sorted(_all(hs)) == [(0, 2), (1, 2)], "two nodes, min 1: the last call closes the round with both"
    assert hs[0].num_nodes_waiting() == 0
    late = _handler(server, min_nodes=1, max_nodes=3)
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(late.next_rendezvous()))
    t.start()
    deadline = time.monotonic() + 10
    while hs[0].num_nodes_waiting() == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert hs[0].num_nodes_waiting() == 1 and hs[1].num_nodes_waiting() == 1
    again = _all(hs)  # the members re-rendezvous (a MembershipChange): the next round has three
    t.join(30)
    assert sorted([*again, (result[0].rank, result[0].world_size)]) == [(0, 3), (1, 3), (2, 3)]


def test_a_node_that_arrives_after_the_close_joins_the_next_round(server: Any) -> None:
    hs = [_handler(server, min_nodes=2, max_nodes=2, join_timeout_s=3.0) for _ in range(3)]
    got = _all(hs, stagger=0.3)  # the third arrives after the first two closed round 0
    members = [g for g in got if isinstance(g, tuple)]
    assert sorted(members) == [(0, 2), (1, 2)] or len(members) == 2
    # the third waits in round 1 (it times out here: no partner); at max, members see no one waiting
    assert all(h.num_nodes_waiting() == 0 for h in hs if h.round == 0)


def test_ranks_follow_host_names_then_pids_not_arrival_order(server: Any) -> None:
    """As torch's c10d handler ranks its participants: a job started host by host gets host order."""
    late_a, early_b = _handler(server), _handler(server)
    late_a._host, early_b._host = "host-a", "host-b"
    got = _all([early_b, late_a], stagger=0.3)  # host-b arrives first
    assert got == [(1, 2), (0, 2)], got


def test_a_stale_leader_is_replaced_and_the_round_still_forms(server: Any) -> None:
    ghost = _client(server)
    ghost.add("tierckpt/rdzv/job/r0/n", 1)  # arrival 0 (the leader) dies before it decides
    hs = [_handler(server, min_nodes=2, max_nodes=3) for _ in range(2)]
    t0 = time.monotonic()
    got = _all(hs)
    assert sorted(got) == [(0, 3), (1, 3)], "the ghost's arrival counts (ranked last); the others take the lead"
    assert 0.3 <= time.monotonic() - t0 < 10


def test_too_few_nodes_time_out_with_a_typed_error(server: Any) -> None:
    h = _handler(server, min_nodes=2, max_nodes=2, join_timeout_s=0.5)
    with pytest.raises(RendezvousTimeoutError, match="1 of 2"):
        h.next_rendezvous()


def test_a_closed_rendezvous_refuses_every_node(server: Any) -> None:
    a, b = _handler(server), _handler(server)
    assert a.shutdown() is True and a.is_closed() and b.is_closed()
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()
    other = _handler(server, run="other-job", join_timeout_s=0.3)
    assert not other.is_closed(), "runs sharing a store are apart"


def test_a_waiting_node_is_released_when_the_rendezvous_closes(server: Any) -> None:
    a, b = _handler(server), _handler(server)
    errs: list[BaseException] = []

    def wait() -> None:
        try:
            a.next_rendezvous()
        except BaseException as exc:  # noqa: BLE001
            errs.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.5)
    b.set_closed()
    t.join(10)
    assert errs and isinstance(errs[0], RendezvousClosedError)


def test_torchs_registry_builds_it_from_the_launchers_parameters(server: Any) -> None:
    register()
    register()  # again: a no-op
    from torch.distributed.elastic.rendezvous import registry

    params = RendezvousParameters(backend=BACKEND, endpoint=f"127.0.0.1:{server.port}", run_id="reg",
                                  min_nodes=1, max_nodes=2, is_host="false", last_call_timeout="0.1")
    h = registry.get_rendezvous_handler(params)
    assert isinstance(h, TierckptRendezvousHandler) and h.get_backend() == BACKEND
    assert (h.min_nodes, h.max_nodes, h.last_call_s, h.get_run_id()) == (1, 2, 0.1, "reg")
    info = h.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert torch_rdzv.store_of(h).port == server.port and torch_rdzv.max_nodes_of(h) == 2


def test_the_launchers_reads_of_torchs_own_handler_still_work(server: Any) -> None:
    """The torch privates torch_rdzv.py reads, pinned on this torch's c10d handler."""
    from torch.distributed.elastic.rendezvous import registry

    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{server.port}", run_id="pin",
                                  min_nodes=1, max_nodes=3, is_host="false")
    h = registry.get_rendezvous_handler(params)
    try:
        assert torch_rdzv.max_nodes_of(h) == 3
        assert torch_rdzv.store_of(h) is not None and torch_rdzv.store_of(h).port == server.port
        count, needed = torch_rdzv.joined(h)
        assert needed == 1 and count == 0
        assert torch_rdzv.standing_by(h) is None
    finally:
        h.shutdown()


def _wait_for(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_a_round_closes_only_on_an_allowed_count_and_the_rest_wait(server: Any) -> None:
    """replicaDiscreteValues [1, 3] (``Elastic.allowed``, narrowed by the supervisor): two nodes
    arrive for a job of 1 to 3; the round closes with one (2 is forbidden), the other waits in the
    next round, and when a third node arrives the running member re-joins and all three form it."""
    hs = [_handler(server, min_nodes=1, max_nodes=3) for _ in range(3)]
    for h in hs:
        assert torch_rdzv.narrow(h, (1, 3))
    got: dict[int, Any] = {}

    def join(i: int) -> None:
        info = hs[i].next_rendezvous()
        got.setdefault(i, []).append((info.rank, info.world_size))

    threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while len(got) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(1.0)  # the other's round does not close meanwhile: nobody of round 0 re-joined
    assert list(got.values()) == [[(0, 1)]], got  # one closed round of one: 2 is forbidden
    member = next(iter(got))
    waiting = 1 - member
    threads += [threading.Thread(target=join, args=(member,)), threading.Thread(target=join, args=(2,))]
    for t in threads[2:]:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted([got[member][1], got[waiting][0], got[2][0]]) == [(0, 3), (1, 3), (2, 3)], got


def test_a_late_node_waits_while_the_running_job_beats_and_closes_once_it_is_gone(server: Any) -> None:
    """min 1: a node arriving after round 0 closed leads round 1 but does not close it alone while
    round 0's members run (their monitors poll ``num_nodes_waiting``, which beats the running job
    once a second); when the beat stands still for ``orphan_s`` (every member gone) it closes. A
    member that left the job (``leave``: a surplus node, a repeat offender) arrives as a newcomer
    and does not stand for the running job."""
    hs = [_handler(server, min_nodes=1, max_nodes=3) for _ in range(2)]
    assert sorted(_all(hs)) == [(0, 2), (1, 2)]
    late = _handler(server, min_nodes=1, max_nodes=3, orphan_s=1.5)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(late.next_rendezvous()))
    t0 = time.monotonic()
    t.start()
    while time.monotonic() - t0 < 4.0:  # the running job's monitors, for 4 s
        for h in hs:
            h.num_nodes_waiting()
        time.sleep(0.1)
    assert not got, "a round closed without the running job while it ran"
    t.join(10)  # the monitors stopped: the job is gone
    assert got and (got[0].rank, got[0].world_size) == (0, 1)
    assert time.monotonic() - t0 >= 4.0 + 1.5 - 1.0  # the beat stood still ~orphan_s (a beat may be up to 1 s old)
    # a member that left the job: no beat, and its arrival is no re-join
    torch_rdzv.leave_round(hs[0])
    assert hs[0].round is None and hs[0].num_nodes_waiting() == 0


def test_after_a_regroup_below_max_the_nodes_waiting_are_counted(server: Any) -> None:
    """A job of 3 (its max) regrouped to 1 without a round (change.shrink): ``num_nodes_waiting``
    answered 0 from the stale size (at max) and the job never grew back; now it counts them."""
    hs = [_handler(server, min_nodes=1, max_nodes=3) for _ in range(3)]
    assert sorted(_all(hs)) == [(0, 3), (1, 3), (2, 3)]
    assert hs[0].num_nodes_waiting() == 0  # at max: no store read
    torch_rdzv.regrouped(hs[0], 1)
    late = _handler(server, min_nodes=1, max_nodes=3, join_timeout_s=2.0)
    t = threading.Thread(target=lambda: pytest.raises(RendezvousTimeoutError, late.next_rendezvous))
    t.start()
    deadline = time.monotonic() + 5
    while hs[0].num_nodes_waiting() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hs[0].num_nodes_waiting() == 1
    t.join(10)


def test_a_big_round_wakes_its_members_rarely_and_its_close_wakes_them_at_once(server: Any) -> None:
    """Only the first DEPUTIES arrivals after the leader look at its beat every second; the other
    members block on the round's world key for about max_nodes / WAKES_PER_S (a round of 4096
    members that woke every second outran torch's legacy store server); ``set_closed`` wakes them
    at once, and the leader polls one counter while the round fills."""
    from tierckpt.launcher.membership import rdzv
    from tierckpt.testing.storecount import Counter, CountingStore

    n = rdzv.DEPUTIES + 4
    counters = [Counter() for _ in range(n)]
    hs = [TierckptRendezvousHandler(CountingStore(_client(server), counters[i]), "big", min_nodes=640,
                                    max_nodes=640, lead_stale_s=3.0) for i in range(n)]
    assert hs[0]._watch_s(1) == 1.0 and 5.0 <= hs[0]._watch_s(rdzv.DEPUTIES + 1) <= 15.0
    errs: list[Any] = [None] * n

    def one(i: int) -> None:
        try:
            hs[i].next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            errs[i] = exc

    threads = []
    for i in range(n):  # one at a time: arrival i is handler i
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
        assert _wait_for(lambda i=i: hs[i].arrived is not None, 10)
    start = [c.value for c in counters]
    time.sleep(3.0)
    ops = [c.value - s for c, s in zip(counters, start, strict=True)]
    assert ops[0] <= 3.0 / 0.01 * 1.2, ops  # the leader: about one operation a poll (poll_s 0.01)
    assert all(0 < o <= 4 * 5 for o in ops[1:rdzv.DEPUTIES + 1]), ops  # deputies: ~5 operations a second
    assert all(o == 0 for o in ops[rdzv.DEPUTIES + 1:]), ops  # the others have not woken
    t0 = time.monotonic()
    hs[0].set_closed()
    for t in threads:
        t.join(10)
    assert time.monotonic() - t0 < 2.0, "set_closed woke the waiting members"
    assert all(isinstance(e, RendezvousClosedError) for e in errs), errs


def test_two_members_that_find_the_leader_stale_make_one_leader(server: Any) -> None:
    """Both deputies judge the dead leader stale at the same moment: the lead is taken from the
    leader they saw (a compare-and-set), so only one of them leads (two leaders once made one's
    ``wait`` return without its keys on torch's libuv server, and the round hung in a multi_get)."""
    ghost = _client(server)
    ghost.add("tierckpt/rdzv/job/r0/n", 1)  # arrival 0 (the leader) dies before it decides
    hs = [_handler(server, min_nodes=2, max_nodes=3) for _ in range(2)]
    led: list[int] = []
    for h in hs:
        real = h._lead
        h._lead = lambda k, *rest, real=real: (led.append(k), real(k, *rest))[1]  # type: ignore[method-assign]
    assert sorted(_all(hs)) == [(0, 3), (1, 3)]
    assert led == [0], led


def _claims(hs: list[TierckptRendezvousHandler], claims: list[Any]) -> None:
    for h, c in zip(hs, claims, strict=True):
        h.claim = (lambda c=c: c)


def test_with_claims_the_round_itself_gives_each_node_its_stable_rank(server: Any) -> None:
    """With the launcher's rank claims (``handler.claim``, set by ``Rounds.gate``) the round's
    leader applies ``ranks.assign`` itself: each node's rank in the round is its stable group rank
    and no second exchange runs (no rank-claim key is written). A lost node's round: the survivors
    keep their ranks though the host order says otherwise, the spare (a newcomer) takes the lost
    rank, and each node's ``decided`` holds the round's memberships."""
    from tierckpt.launcher.control import keys
    from tierckpt.launcher.membership.ranks import Claim

    hs = [_handler(server, min_nodes=3, max_nodes=3) for _ in range(3)]
    for h, host in zip(hs, ("host-c", "host-b", "host-a"), strict=True):
        h._host = host
    idents = ["c:/shm", "b:/shm", "a:/shm"]
    _claims(hs, [Claim(prior=None, identity=x) for x in idents])
    got = _all(hs)
    assert got == [(2, 3), (1, 3), (0, 3)], "the first round: host order (no node remembers a rank)"
    first = [h.decided for h in hs]
    assert all(d is not None and d.rank == g[0] for d, g in zip(first, got, strict=True))
    before, after = first[0].memberships()  # type: ignore[union-attr]
    assert before == {} and after == {2: "c:/shm", 1: "b:/shm", 0: "a:/shm"}
    assert not server.check([hs[0]._r(0, "") + "/" + keys.rank_claim(0)]), "no exchange after the round"
    # host-b (rank 1) is lost; a spare on host-0 (first in host order) comes; c and a survive
    spare = _handler(server, min_nodes=3, max_nodes=3)
    spare._host = "host-0"
    survivors = [hs[0], hs[2]]
    _claims(survivors + [spare], [
        Claim(prior=d.rank, survivor=True, identity=x, members=after, digest=d.digest)  # type: ignore[union-attr]
        for d, x in ((first[0], "c:/shm"), (first[2], "a:/shm"))] + [Claim(prior=None, identity="spare:/shm")])
    got = _all(survivors + [spare])
    assert got == [(2, 3), (0, 3), (1, 3)], got
    before, after2 = spare.decided.memberships()  # type: ignore[union-attr]
    assert before == after and after2 == {2: "c:/shm", 0: "a:/shm", 1: "spare:/shm"}
    assert hs[0].decided is not None and hs[0].decided.memberships()[1] == after2  # the survivor's from the diff
    assert hs[0].decided.digest == spare.decided.digest  # type: ignore[union-attr]


def test_the_round_key_is_the_round_stores_key(server: Any) -> None:
    """The leader writes the decision through the round store and each member reads it with its
    rank in one call by its full key: the two must name the same key."""
    h = _handler(server)
    h._round_store(5).set("tierckpt/rank-decided", b"x")
    assert server.get(h._round_key(5, "tierckpt/rank-decided")) == b"x"


def test_with_claims_a_member_that_never_registered_breaks_the_round_and_the_next_forms(server: Any) -> None:
    """An arrival that died before it registered (its ``add``, no descriptor): the leader waits
    ``claims_s`` for it and breaks the round (``ranks.RoundBroken`` on every member, as the
    exchange did), and the next round forms without it."""
    from tierckpt.launcher.membership.ranks import Claim, RoundBroken

    ghost = _client(server)
    hs = [_handler(server, min_nodes=2, max_nodes=3, claims_s=0.5) for _ in range(2)]
    _claims(hs, [Claim(prior=None, identity=f"n{i}") for i in range(2)])
    ghost.add("tierckpt/rdzv/job/r0/n", 1)  # arrival 0 (the leader) dies before it decides
    got = _all(hs)
    assert all(isinstance(g, RoundBroken) for g in got), got
    assert sorted(_all(hs)) == [(0, 2), (1, 2)], "the next round: the two live nodes"
