"""The agent's pure parts: framing, request validation, the ring, the budget's eviction order, the
in-stream item check."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from tierckpt import layout
from tierckpt.agent import protocol as p
from tierckpt.agent.config import AgentConfig, parse_budget
from tierckpt.agent.state import ring_targets
from tierckpt.agent.store import Held, select_evictions
from tierckpt.agent.transfer import StreamCheck, split_ranges
from tierckpt.errors import ConfigError, IntegrityError


def test_frames_round_trip_and_reject_garbage() -> None:
    raw = p.encode({"op": "list", "ns": "run1"})
    assert p.decode_body(raw[p.HEADER.size :]) == {"op": "list", "ns": "run1"}
    assert p.parse_header(raw[: p.HEADER.size]) == len(raw) - p.HEADER.size
    with pytest.raises(p.ProtocolViolation, match="magic"):
        p.parse_header(b"GET / HT")
    with pytest.raises(p.ProtocolViolation, match="exceeds"):
        p.parse_header(p.HEADER.pack(p.MAGIC, p.MAX_BODY + 1))
    with pytest.raises(p.ProtocolViolation, match="truncated"):
        p.parse_header(raw[:5])
    with pytest.raises(p.ProtocolViolation, match="JSON"):
        p.decode_body(b"\xff\x00{")
    with pytest.raises(p.ProtocolViolation, match="op"):
        p.decode_body(b"[1, 2]")


@pytest.mark.parametrize("body", [
    {"op": "get", "ns": "../etc", "origin": "a", "step": 1, "name": "COMMITTED"},
    {"op": "get", "ns": "run", "origin": "../a", "step": 1, "name": "COMMITTED"},
    {"op": "get", "ns": "run", "origin": "a", "step": 1, "name": "../../passwd"},
    {"op": "get", "ns": "run", "origin": "a", "step": 1, "name": "/etc/passwd"},
    {"op": "get", "ns": "run", "origin": "a", "step": -1, "name": "COMMITTED"},
    {"op": "get", "ns": "run", "origin": "a", "step": True, "name": "COMMITTED"},
    {"op": "get", "ns": "run", "origin": "a", "step": "1", "name": "COMMITTED"},
    {"op": "put", "ns": "run", "origin": "a", "step": 1, "save_id": "x", "files": [["__0_0.distcp", 2**41]]},
    {"op": "put", "ns": "run", "origin": "a", "step": 1, "save_id": "x/y", "files": [["__0_0.distcp", 1]]},
    {"op": "put", "ns": "run", "origin": "a", "step": 1, "save_id": "x", "files": [["a", 1], ["a", 1]]},
    {"op": "put", "ns": "run", "origin": "a", "step": 1, "save_id": "x", "files": []},
    {"op": "rm", "ns": "run"},
])
def test_requests_name_storage_only_through_validated_values(body: dict) -> None:
    with pytest.raises(p.ProtocolViolation):
        p.parse_request(body)


def test_valid_requests_parse() -> None:
    got = p.parse_request({"op": "get", "ns": "run-1", "origin": "host-ab12", "step": 7, "name": "__3_0.distcp"})
    assert got == p.Get("run-1", "host-ab12", 7, "__3_0.distcp")
    put = p.parse_request({"op": "put", "ns": "r", "origin": "n", "step": 2, "save_id": "abc",
                           "files": [["__0_0.distcp", 10], [".metadata", 3]], "keep": [1, 2], "owner": "ab" * 32})
    assert isinstance(put, p.Put) and put.nbytes == 13 and put.keep == frozenset({1, 2})


def test_macs_bind_both_nonces_the_secret_and_the_channel() -> None:
    a, b = "ab" * 32, "cd" * 32
    tls = p.channel_binding("tls13", b"\x01" * 32)
    mac = p.client_mac(b"s", a, b, "n1", "n2", tls)
    assert mac != p.client_mac(b"t", a, b, "n1", "n2", tls)
    assert mac != p.server_mac(b"s", a, b, "n1", "n2", tls)
    assert mac != p.client_mac(b"s", a, b, "n1", "n3", tls)  # the node ids count
    assert mac != p.client_mac(b"s", b, a, "n1", "n2", tls)
    assert mac != p.client_mac(b"s", a, b, "n1", "n2", p.channel_binding("tls13", b"\x02" * 32))  # the certificate
    assert mac != p.client_mac(b"s", a, b, "n1", "n2", p.channel_binding("insecure", b""))  # the wire
    with pytest.raises(p.ProtocolViolation, match="authentication"):
        p.check_mac(mac, p.client_mac(b"t", a, b, "n1", "n2", tls))
    for bad in ("\u00e9" * 64, None, 7, b"ab" * 32):
        with pytest.raises(p.ProtocolViolation, match="authentication"):
            p.check_mac(mac, bad)


def test_ring_gives_every_node_k_other_holders() -> None:
    nodes = ["n3", "n1", "n2"]
    assert ring_targets(nodes, "n1", 1) == ["n2"]
    assert ring_targets(nodes, "n3", 1) == ["n1"]
    assert ring_targets(nodes, "n2", 2) == ["n3", "n1"]
    assert ring_targets(nodes, "n2", 5) == ["n3", "n1"]  # never itself, never twice
    assert ring_targets(["n1"], "n1", 1) == []
    holders = {n: 0 for n in nodes}
    for n in nodes:
        for t in ring_targets(nodes, n, 2):
            holders[t] += 1
    assert set(holders.values()) == {2}


def _held(kind: str, ns: str, step: int, mtime: float, newest: bool, nbytes: int = 10) -> Held:
    return Held(kind, ns, "o" if kind == "replica" else "", step, nbytes, mtime, newest)


def test_eviction_order_cache_then_old_own_then_old_replicas_then_newest_replicas() -> None:
    entries = [
        _held("own", "a", 1, 1.0, False), _held("own", "a", 2, 5.0, True),
        _held("own", "b", 7, 2.0, False), _held("own", "b", 8, 6.0, True),
        _held("replica", "a", 1, 0.5, False), _held("replica", "a", 2, 4.0, True),
        _held("cache", "a", 2, 9.0, False),
    ]
    order = [(h.kind, h.namespace, h.step) for h in select_evictions(entries, 10**9)]
    assert order == [("cache", "a", 2), ("own", "a", 1), ("own", "b", 7), ("replica", "a", 1), ("replica", "a", 2)]
    assert [(h.kind, h.step) for h in select_evictions(entries, 15)] == [("cache", 2), ("own", 1)]
    agent_order = [(h.kind, h.step) for h in select_evictions(entries, 10**9, ("cache", "replica"))]
    assert agent_order == [("cache", 2), ("replica", 1), ("replica", 2)]
    assert select_evictions(entries, 0) == []


def test_budget_and_config_validation() -> None:
    assert parse_budget("40%", 1000) == 400
    assert parse_budget("64G", 0) == 64 << 30
    assert parse_budget("1024", 0) == 1024
    for bad in ("10%", "101%", "lots", "-5"):
        with pytest.raises(ConfigError):
            parse_budget(bad, 1000)
    with pytest.raises(ConfigError, match="secret"):
        AgentConfig(memory_dir="/dev/shm/x", listen=("0.0.0.0", 0))
    assert AgentConfig(memory_dir="/dev/shm/x", listen=("0.0.0.0", 0), secret=b"k").listen[0] == "0.0.0.0"
    with pytest.raises(ConfigError, match="node id"):
        AgentConfig(memory_dir="/dev/shm/x", node_id="a/b")
    assert AgentConfig(memory_dir="/dev/shm/x").node_id == AgentConfig(memory_dir="/dev/shm/x/").node_id


def _records(data: bytes, spans: list[tuple[int, int]]) -> list[layout.ItemRecord]:
    return [layout.ItemRecord("__0_0.distcp", off, n, -1, layout.checksum(data[off : off + n])) for off, n in spans]


def _feed(check: StreamCheck, data: bytes, chunk: int) -> None:
    for i in range(0, len(data), chunk):
        check.update(memoryview(data)[i : i + chunk])
    check.finish()


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_stream_check_verifies_each_item_in_one_pass_whatever_the_chunks(chunk: int) -> None:
    data = bytes(random.Random(chunk).getrandbits(8) for _ in range(20_000))
    spans = [(0, 100), (100, 0), (128, 5000), (5128, 1), (9000, 11_000)]  # gaps, an empty item, to the end
    mf = SimpleNamespace(items=_records(data, spans))
    check = StreamCheck.for_file(mf, "__0_0.distcp", len(data), "w")  # type: ignore[arg-type]
    assert check is not None
    _feed(check, data, chunk)
    bad = bytearray(data)
    bad[3000] ^= 0xFF  # inside the third item
    check = StreamCheck.for_file(mf, "__0_0.distcp", len(data), "w")  # type: ignore[arg-type]
    assert check is not None
    with pytest.raises(IntegrityError, match="offset 128 "):
        _feed(check, bytes(bad), chunk)
    gap = bytearray(data)
    gap[7000] ^= 0xFF  # between items: no record covers it, as for verify_items
    check = StreamCheck.for_file(mf, "__0_0.distcp", len(data), "w")  # type: ignore[arg-type]
    assert check is not None
    _feed(check, bytes(gap), chunk)


def test_stream_check_refuses_what_it_cannot_check_in_order() -> None:
    data = bytes(range(256)) * 4
    overlapping = SimpleNamespace(items=_records(data, [(0, 100), (50, 100)]))
    assert StreamCheck.for_file(overlapping, "__0_0.distcp", len(data), "w") is None  # type: ignore[arg-type]
    past_end = SimpleNamespace(items=_records(data, [(0, 100), (1000, 100)]))
    with pytest.raises(IntegrityError, match="past the file"):
        StreamCheck.for_file(past_end, "__0_0.distcp", len(data), "w")  # type: ignore[arg-type]
    short = StreamCheck.for_file(SimpleNamespace(items=_records(data, [(0, 1000)])), "__0_0.distcp", len(data), "w")  # type: ignore[arg-type]
    assert short is not None
    short.update(memoryview(data)[:500])
    with pytest.raises(IntegrityError, match="past the 500 bytes"):
        short.finish()


def test_parts_for_parallel_fetches_cut_at_item_boundaries_and_cover_the_file() -> None:
    data = bytes(1000)
    recs = _records(data, [(0, 100), (100, 300), (400, 50), (450, 500), (950, 50)])
    parts = split_ranges(recs, 1000, 4, 100)
    # cuts at the first item at or past 250, 500 and 750 (none past 950: three parts)
    assert [(o, n) for o, n, _ in parts] == [(0, 400), (400, 550), (950, 50)]
    assert [[r.offset for r in rs] for _, _, rs in parts] == [[0, 100], [400, 450], [950]]
    assert [(o, n) for o, n, _ in split_ranges(recs, 1000, 4, 600)] == [(0, 1000)]  # parts too small: one
    assert [(o, n) for o, n, _ in split_ranges(recs, 1000, 2, 100)] == [(0, 950), (950, 50)]
    mf = SimpleNamespace(items=recs)
    check = StreamCheck(parts[1][2], "w", start=parts[1][0])  # a part checks its own items from its offset
    check.update(memoryview(data)[400:950])
    check.finish()
    assert StreamCheck.for_file(mf, "__0_0.distcp", 1000, "w") is not None  # type: ignore[arg-type]
    assert p.parse_request({"op": "get", "ns": "run1", "origin": "n", "step": 1, "name": "COMMITTED",
                            "offset": 5, "length": 7}) == p.Get("run1", "n", 1, "COMMITTED", 5, 7)
    for offset, length in ((-1, 5), (0, -5), (True, 5), (0, 1 << 41)):
        with pytest.raises(p.ProtocolViolation):
            p.parse_request({"op": "get", "ns": "run1", "origin": "n", "step": 1, "name": "COMMITTED",
                             "offset": offset, "length": length})
