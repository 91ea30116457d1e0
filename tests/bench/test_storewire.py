"""``bench/storewire.py``, the pure-Python TCPStore client of bench rdzv's greenlet agents, against
torch's own client on the real store servers (libuv, the job's; and the legacy one): what one
writes the other reads, and the blocking calls (``wait``, ``get`` of a missing key) behave as
torch's do, a timed-out ``wait`` included. A fast test: no simulation."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from tierckpt.bench.storewire import WirePrefixStore, WireStore


@pytest.fixture(params=[True, False], ids=["libuv", "legacy"])
def server(request: Any) -> Iterator[Any]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,  # type: ignore[attr-defined]
                          use_libuv=request.param)
    yield store
    del store


def _torch(server: Any) -> Any:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False)  # type: ignore[attr-defined]


def test_what_one_client_writes_the_other_reads(server: Any) -> None:
    ours, theirs = WireStore("127.0.0.1", server.port), _torch(server)
    ours.set("a/b", b"\x00\xffbytes")
    assert theirs.get("a/b") == b"\x00\xffbytes"
    theirs.set("c", "from torch")
    assert ours.get("c") == b"from torch"
    assert ours.add("n", 3) == 3 and theirs.add("n", 2) == 5 and ours.add("n", 0) == 5
    assert ours.compare_set("cs", b"", b"first") == b"first"  # a missing key with empty expected: set
    assert ours.compare_set("cs", b"other", b"x") == b"first"  # no match: the value, unchanged
    assert theirs.get("cs") == b"first"
    assert ours.check(["a/b", "c"]) and not ours.check(["a/b", "missing"])
    ours.multi_set(["m/0", "m/1", "m/2"], [b"0", "1", b"2" * 70000])
    assert theirs.multi_get(["m/0", "m/1", "m/2"]) == [b"0", b"1", b"2" * 70000]
    theirs.multi_set(["t/0", "t/1"], [b"x", b"y"])
    assert ours.multi_get(["t/0", "t/1"]) == [b"x", b"y"]
    ours.close()


def test_the_blocking_calls_block_until_the_key_and_a_wait_times_out_as_torchs(server: Any) -> None:
    ours, theirs = WireStore("127.0.0.1", server.port, timeout=datetime.timedelta(seconds=5)), _torch(server)
    threading.Timer(0.3, lambda: theirs.set("late", b"v")).start()
    t0 = time.monotonic()
    assert ours.get("late") == b"v" and 0.25 < time.monotonic() - t0 < 3
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        ours.wait(["never"], datetime.timedelta(seconds=0.3))
    assert 0.25 < time.monotonic() - t0 < 3
    assert ours.add("after", 1) == 1, "the connection is usable after a cancelled wait"
    threading.Timer(0.2, lambda: theirs.set("w", b"1")).start()
    ours.wait(["w"], datetime.timedelta(seconds=5))
    ours.close()


def test_the_prefix_store_names_keys_as_torchs_prefix_store(server: Any) -> None:
    ours, theirs = WireStore("127.0.0.1", server.port), _torch(server)
    WirePrefixStore("round/3/", ours).set("k", b"v")
    assert dist.PrefixStore("round/3/", theirs).get("k") == b"v"  # type: ignore[attr-defined]
    dist.PrefixStore("round/3/", theirs).set("j", b"w")  # type: ignore[attr-defined]
    p = WirePrefixStore("round/3/", ours)
    assert p.multi_get(["k", "j"]) == [b"v", b"w"] and p.check(["j"]) and p.add("n", 2) == 2
    ours.close()
