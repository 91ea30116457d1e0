"""ClaimWatch on a real TCPStore (both of torch's servers): another node's claim wakes the agent
within the store's round trip instead of the next poll, and the safety read covers a claimer
that died between its ``compare_set`` and its wake-up key, and a watch that cannot connect."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from tierckpt.launcher.control.claimwatch import ClaimWatch
from tierckpt.launcher.control.jobcontrol import JobControl
from tierckpt.launcher.control.store import connect_client


@pytest.fixture(params=[False, True], ids=["legacy-server", "libuv-server"])
def server(request: pytest.FixtureRequest) -> Iterator[dist.TCPStore]:  # type: ignore[name-defined]
    yield dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=request.param,  # type: ignore[attr-defined]
                        timeout=datetime.timedelta(seconds=10))


def _watch(server: dist.TCPStore, **kw: float) -> tuple[ClaimWatch, threading.Event]:  # type: ignore[name-defined]
    woke = threading.Event()
    return ClaimWatch(lambda: connect_client("127.0.0.1", server.port), woke.set,
                      lambda g: JobControl(connect_client("127.0.0.1", server.port)).release_claim_waiters(g),
                      **kw), woke


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tierckpt-claim-watch"]


def test_close_ends_the_wait_and_the_thread(server: dist.TCPStore) -> None:  # type: ignore[name-defined]
    """Reproduces the SIGABRT of an agent that exited while its watch was blocked in the C++ wait
    and the store closed the connection: close must leave no thread in the wait."""
    before = set(_threads())
    watch, _ = _watch(server, safety_poll_s=30.0)
    watch.follow(0)
    time.sleep(0.3)  # blocked in the store's wait
    assert len(set(_threads()) - before) == 1
    t0 = time.monotonic()
    watch.close()
    assert not (set(_threads()) - before), "the watch thread outlived close()"
    assert time.monotonic() - t0 < 2.0


def test_another_agent_leaving_makes_the_watch_read_every_tick_not_go_blind(
        server: dist.TCPStore) -> None:  # type: ignore[name-defined]
    stays, woke = _watch(server, safety_poll_s=30.0)
    leaves, _ = _watch(server, safety_poll_s=30.0)
    try:
        stays.follow(2)
        leaves.follow(2)
        time.sleep(0.3)
        assert stays.due(2) and not stays.due(2)
        leaves.close()  # releases generation 2's waiters with no claim behind
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not (stays.due(2) and stays.due(2)):
            time.sleep(0.02)
        assert stays.due(2) and stays.due(2) and stays.due(2)  # no claim was reported: every tick reads
        assert not woke.is_set() and stays.wakes == 0
        stays.follow(3)  # the next generation is pushed again
        assert stays.due(3) and not stays.due(3)
        time.sleep(0.3)
        JobControl(server).claim(3, {"reason": "Crash", "node": 0})
        assert woke.wait(5.0) and stays.wakes == 1
    finally:
        stays.close()


def test_a_claim_wakes_the_loop_and_is_due_at_once(server: dist.TCPStore) -> None:  # type: ignore[name-defined]
    watch, woke = _watch(server, safety_poll_s=30.0)
    try:
        watch.follow(0)
        assert watch.due(0)  # the first read of a generation is at once
        assert not watch.due(0)  # then only the safety read, 30 s later, or a wake-up
        time.sleep(0.3)  # the thread is blocked in the store's wait
        t0 = time.monotonic()
        JobControl(server).claim(0, {"reason": "Crash", "node": 1})
        assert woke.wait(5.0), "the claim did not wake the loop"
        print(f"claim -> loop woken: {time.monotonic() - t0:.4f}s")
        assert watch.due(0) and watch.due(0)  # claimed: every tick reads it until the generation moves
        assert watch.wakes == 1
        woke.clear()
        watch.follow(1)  # the next generation: one read at once, then quiet again
        assert watch.due(1) and not watch.due(1)
        time.sleep(0.3)
        JobControl(server).claim(1, {"reason": "Hang", "node": 0})
        assert woke.wait(5.0) and watch.wakes == 2
    finally:
        watch.close()


def test_a_generation_that_ended_unclaimed_leaves_no_blind_watch(server: dist.TCPStore) -> None:  # type: ignore[name-defined]
    before = set(_threads())
    watch, woke = _watch(server, safety_poll_s=30.0)
    try:
        watch.follow(4)
        time.sleep(0.3)
        watch.follow(5)  # generation 4 ended without a claim: its wait is released, the thread follows 5
        time.sleep(0.3)
        assert len(set(_threads()) - before) == 1  # one thread for the watch's life
        JobControl(server).claim(5, {"reason": "Crash", "node": 1})
        assert woke.wait(5.0) and watch.wakes == 1
        assert watch.due(5)
    finally:
        watch.close()


def test_a_claim_without_its_wakeup_key_is_read_by_the_safety_poll(server: dist.TCPStore) -> None:  # type: ignore[name-defined]
    """The claimer died between its ``compare_set`` and its ``set``: written here as that
    ``compare_set`` alone. No wake-up comes; the safety read finds the claim."""
    watch, woke = _watch(server, safety_poll_s=0.3)
    ctl = JobControl(connect_client("127.0.0.1", server.port))
    try:
        watch.follow(0)
        assert watch.due(0) and ctl.claimed(0) is None
        server.compare_set("tierckpt/run/fault/0", b"", b'{"reason": "LostNode", "node": 1}')
        deadline = time.monotonic() + 5.0
        seen = None
        while seen is None and time.monotonic() < deadline:
            time.sleep(0.05)
            if watch.due(0):
                seen = ctl.claimed(0)
        assert seen == {"reason": "LostNode", "node": 1}
        assert not woke.is_set() and watch.wakes == 0
    finally:
        watch.close()


def test_a_watch_that_cannot_reach_the_store_reads_every_tick() -> None:
    def refuse() -> None:
        raise ConnectionRefusedError("no store")

    watch = ClaimWatch(refuse, lambda: None, safety_poll_s=30.0)
    watch.follow(0)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and not (watch.due(0) and watch.due(0) and watch.due(0)):
        time.sleep(0.02)
    assert watch.due(0) and watch.due(0)  # broken: the loop reads the claim key every tick, as before
    watch.close()
