"""The agent's pure parts: framing, request validation, the ring, the budget's eviction order."""

from __future__ import annotations

import pytest

from tierckpt.agent import protocol as p
from tierckpt.agent.config import AgentConfig, parse_budget
from tierckpt.agent.service import ring_targets
from tierckpt.agent.store import Held, select_evictions
from tierckpt.errors import ConfigError


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
                           "files": [["__0_0.distcp", 10], [".metadata", 3]], "keep": [1, 2]})
    assert isinstance(put, p.Put) and put.nbytes == 13 and put.keep == frozenset({1, 2})


def test_macs_bind_both_nonces_and_the_secret() -> None:
    a, b = "ab" * 32, "cd" * 32
    assert p.client_mac(b"s", a, b) != p.client_mac(b"t", a, b)
    assert p.client_mac(b"s", a, b) != p.server_mac(b"s", a, b)
    with pytest.raises(p.ProtocolViolation, match="authentication"):
        p.check_mac(p.client_mac(b"s", a, b), p.client_mac(b"t", a, b))


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
