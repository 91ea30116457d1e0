"""Agents in this process on loopback: replication, reads from peers, corruption, interrupted
transfers, hostile clients, the node budget and flush. Each node is an agent with its own root."""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch

import tierckpt
from tests.agent.conftest import lose_namespace, wait_for
from tierckpt import layout
from tierckpt.agent import protocol as p
from tierckpt.agent.client import Connection, PeerClient, PeerError
from tierckpt.agent.store import NodeStore
from tierckpt.tiers.integrity import verify_copy
from tierckpt.tiers.peer import local_request

NS = "agent-run"
SECRET = b"job-secret-1"


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 64, generator=g), "ids": torch.randint(0, 1000, (100,), generator=g), "step": step}


def _zeros() -> dict:
    return {"w": torch.zeros(256, 64), "ids": torch.zeros(100, dtype=torch.int64), "step": -1}


def _save(memory_dir: str, steps: list[int], **kw) -> None:
    with tierckpt.Checkpointer(tierckpt.CheckpointConfig(namespace=NS, memory_dir=memory_dir, **kw)) as ck:
        for s in steps:
            ck.save(s, _state(s))
        ck.wait()


def _load(memory_dir: str, **kw) -> tuple[int | None, list[str], dict]:
    sd = _zeros()
    with tierckpt.Checkpointer(tierckpt.CheckpointConfig(namespace=NS, memory_dir=memory_dir, **kw)) as ck:
        step = ck.load(sd)
        return step, ck.last_load.get("tiers", []), sd


def _replica_steps(memory_dir: str, origin: str) -> list[int]:
    return [s.step for s in NodeStore(memory_dir, "x").replica(origin, NS).list_steps()]


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in b)


def test_committed_step_is_replicated_bitwise(node_dir, agent) -> None:
    a_dir, b_dir = node_dir("a"), node_dir("b")
    b = agent(memory_dir=b_dir, node_id="node-b", secret=SECRET)
    agent(memory_dir=a_dir, node_id="node-a", peers=(b.address,), secret=SECRET)
    _save(a_dir, [1, 2])
    wait_for(lambda: 2 in _replica_steps(b_dir, "node-a"), "step 2 replicated to node-b")
    own = Path(a_dir, NS, "step_2")
    rep = Path(b_dir, layout.REPLICAS, "node-a", NS, "step_2")
    names = sorted(f.name for f in own.iterdir())
    assert names == sorted(f.name for f in rep.iterdir())
    assert "__0_0.distcp" in names and layout.MARKER in names
    for name in names:
        assert (own / name).read_bytes() == (rep / name).read_bytes(), name
    assert verify_copy(NodeStore(b_dir, "node-b").replica("node-a", NS), 2, NS).ok


@pytest.mark.parametrize("streams", [1, 4], ids=["one-stream", "parts-in-parallel"])
def test_wiped_node_loads_its_shards_from_a_peer_replica(node_dir, agent, streams: int) -> None:
    a_dir, b_dir = node_dir("a"), node_dir("b")
    b = agent(memory_dir=b_dir, node_id="node-b", secret=SECRET)
    # parts of >= 4 KiB: the 64 KiB tensor and the small items arrive over separate connections
    a = agent(memory_dir=a_dir, node_id="node-a", peers=(b.address,), secret=SECRET, fetch_streams=streams,
              fetch_part_bytes=4096)
    _save(a_dir, [3])
    wait_for(lambda: _replica_steps(b_dir, "node-a") == [3], "replica of step 3")
    lose_namespace(a, a_dir, NS, ["node-b"])  # the node lost its memory tier (the agent's socket stays)
    step, tiers, sd = _load(a_dir)
    assert (step, tiers) == (3, ["peer"])
    assert _equal(sd, _state(3))
    status = a.status()
    assert status["node"] == "node-a"
    assert status["last_fetch"]["name"].endswith(".distcp") and status["last_fetch"]["from"] == "node-b"


def test_corrupted_replica_is_skipped_for_another_holder_then_durable(node_dir, agent, tmp_path) -> None:
    a_dir, b_dir, c_dir = node_dir("a"), node_dir("b"), node_dir("c")
    b = agent(memory_dir=b_dir, node_id="node-b", secret=SECRET)
    c = agent(memory_dir=c_dir, node_id="node-c", secret=SECRET)
    a = agent(memory_dir=a_dir, node_id="node-a", peers=(b.address, c.address), replicas=2, secret=SECRET,
              fetch_part_bytes=4096)  # fetched in parts over parallel connections, each checked on the way
    durable = f"file://{tmp_path / 'durable'}"
    _save(a_dir, [4], durable_url=durable, durable_every_n_steps=1)
    wait_for(lambda: _replica_steps(b_dir, "node-a") == [4] and _replica_steps(c_dir, "node-a") == [4], "two replicas")
    lose_namespace(a, a_dir, NS, ["node-b", "node-c"])

    def flip(root: str) -> None:
        path = Path(root, layout.REPLICAS, "node-a", NS, "step_4", "__0_0.distcp")
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))

    flip(b_dir)  # one holder bad: the other one serves
    step, tiers, sd = _load(a_dir, durable_url=durable)
    assert (step, tiers) == (4, ["peer"]) and _equal(sd, _state(4))
    shutil.rmtree(Path(a_dir, layout.PEER_CACHE))
    flip(c_dir)  # every replica bad: the durable tier serves
    step, tiers, sd = _load(a_dir, durable_url=durable)
    assert step == 4 and "durable" in tiers and _equal(sd, _state(4))


def _open_put(address: tuple[str, int], node: str, announced: int) -> tuple[PeerClient, dict]:
    """A put announced (the sender's first frame); the client and the peer's answer (ready, or why not)."""
    client = PeerClient.connect(address, node, SECRET)
    client.send({"op": "put", "ns": NS, "origin": node, "step": 9, "save_id": "abc123", "owner": "ab" * 32,
                 "files": [["__0_0.distcp", announced], [".metadata", 10], ["manifest.json", 10], ["COMMITTED", 10]]})
    return client, client.recv()


def test_interrupted_transfer_leaves_no_replica_and_the_agent_keeps_serving(node_dir, agent) -> None:
    b_dir = node_dir("b")
    b = agent(memory_dir=b_dir, node_id="node-b", secret=SECRET)
    client, ready = _open_put(b.address, "node-x", 4 << 20)
    assert ready["op"] == "ready"
    client.send_bytes(b"\0" * (1 << 20))  # a quarter of the data file, then the sender dies
    client.close()
    staging = Path(b_dir, layout.REPLICAS, "node-x", NS, layout.STAGING)
    wait_for(lambda: not any(staging.glob("*")), "the partial transfer's staging directory to be removed")
    assert _replica_steps(b_dir, "node-x") == []
    # a complete transfer of garbage fails verification and leaves nothing either
    def ready_put() -> PeerClient | None:  # once the dead transfer's put is no longer in flight
        client, ready = _open_put(b.address, "node-x", 100)
        if ready["op"] == "ready":
            return client
        client.close()
        return None

    client = wait_for(ready_put, "a new put of step 9 to be accepted")
    client.send_bytes(b"\1" * 100)
    for _ in range(3):
        client.send_bytes(b"\1" * 10)
    reply = client.recv()
    assert reply["op"] == "error" and "rejected" in reply["message"]
    client.close()
    assert _replica_steps(b_dir, "node-x") == []
    good = PeerClient.connect(b.address, "node-y", SECRET)
    assert good.list(NS) == []
    good.close()


def _raw(address: tuple[str, int]) -> socket.socket:
    s = socket.create_connection(address, timeout=10)
    Connection(s).recv()  # the hello
    return s


def _closed_by_server(s: socket.socket) -> bool:
    try:
        while True:
            chunk = s.recv(1 << 16)
            if not chunk:
                return True
    except ConnectionResetError:
        return True
    except OSError as exc:  # ENOTCONN: the server's close reached it first (a timeout is no close)
        if exc.errno == errno.ENOTCONN:
            return True
        raise
    finally:
        s.close()


def test_hostile_clients_are_disconnected_and_good_ones_served(node_dir, agent) -> None:
    a_dir = node_dir("a")
    _save(a_dir, [1])
    a = agent(memory_dir=a_dir, node_id="node-a", secret=SECRET, replicas=0)
    # garbage, an oversize length, a truncated frame
    for payload in (b"GET / HTTP/1.1\r\n\r\n", p.HEADER.pack(p.MAGIC, 1 << 30), p.encode({"op": "auth"})[:11]):
        s = _raw(a.address)
        try:
            s.sendall(payload)
            if payload.startswith(p.MAGIC) and len(payload) == 11:
                try:
                    s.shutdown(socket.SHUT_WR)
                except OSError:  # the server closed it first (a loaded machine: ENOTCONN): what is tested
                    pass
            assert _closed_by_server(s)
        finally:
            s.close()  # an unclosed socket surfaces as a ResourceWarning in a later test's gc
    # a wrong secret
    with pytest.raises(PeerError, match="authentication|refused"):
        PeerClient.connect(a.address, "node-z", b"wrong")
    # requests that try to leave the memory root, after a valid handshake
    for body in ({"op": "get", "ns": NS, "origin": "node-a", "step": 1, "name": "../../../etc/passwd"},
                 {"op": "get", "ns": "..", "origin": "node-a", "step": 1, "name": "COMMITTED"},
                 {"op": "list", "ns": "../" + NS},
                 {"op": "put", "ns": NS, "origin": "node-a", "step": 1, "save_id": "s", "files": [["__0_0.distcp", 1]]}):
        client = PeerClient.connect(a.address, "node-z", SECRET)
        with pytest.raises(PeerError):
            client.call(body)
        assert _closed_by_server(client.sock)
    assert a._agent.metrics.rejected.value() >= 7
    good = PeerClient.connect(a.address, "node-y", SECRET)
    steps = good.list(NS)
    assert [(e["step"], e["origin"]) for e in steps] == [(1, "node-a")]
    with pytest.raises(PeerError, match="bytes, not"):  # a range past the end: refused, the connection lives on
        good.call({"op": "get", "ns": NS, "origin": "node-a", "step": 1, "name": layout.MANIFEST,
                   "offset": 1 << 30, "length": 5})
    dest = Path(a_dir, "fetched")
    assert good.get_into(NS, "node-a", 1, layout.MANIFEST, dest) == dest.stat().st_size > 0
    good.close()


def test_node_budget_evicts_replicas_never_own_steps(node_dir, agent) -> None:
    a_dir, b_dir = node_dir("a"), node_dir("b")
    b = agent(memory_dir=b_dir, node_id="node-b", secret=SECRET)
    agent(memory_dir=a_dir, node_id="node-a", peers=(b.address,), secret=SECRET)
    _save(a_dir, [1])
    wait_for(lambda: _replica_steps(b_dir, "node-a") == [1], "replica on node-b")
    _save(b_dir, [5, 6], memory_steps_retained=2)  # node-b's own namespace: two steps
    store = NodeStore(b_dir, "node-b")
    used = store.usage_bytes()
    b.close()
    small = agent(memory_dir=b_dir, node_id="node-b", secret=SECRET, budget_bytes=used - 1, replicas=0)
    small.tick()
    assert _replica_steps(b_dir, "node-a") == []  # the replica went
    assert [s.step for s in store.own(NS).list_steps()] == [5, 6]  # own steps are the trainers' to evict
    reply = local_request(b_dir, {"op": "make_room", "bytes": used})
    assert reply["ok"] is False and reply["budget_bytes"] == used - 1
    assert [s.step for s in store.own(NS).list_steps()] == [5, 6]
    # a replica that cannot fit is refused, and nothing of it stays
    client, reply = _open_put(small.address, "node-x", used)
    client.close()
    assert reply["op"] == "error" and "node budget" in reply["message"]
    assert _replica_steps(b_dir, "node-x") == []


def test_flush_drains_the_newest_step_to_durable(node_dir, agent, tmp_path) -> None:
    a_dir = node_dir("a")
    url = f"file://{tmp_path / 'durable'}"
    a = agent(memory_dir=a_dir, node_id="node-a", durable_url=url, replicas=0)
    _save(a_dir, [7, 8])
    reply = local_request(a_dir, {"op": "flush", "ns": NS})
    assert reply["ok"] and reply["drained"][NS]["step"] == 8 and reply["drained"][NS]["state"] == "durable"
    assert "__0_0.distcp" in reply["drained"][NS]["files"]
    assert a.flush(NS)["drained"][NS] == {"step": 8, "state": "durable"}  # already there: nothing copied
    lose_namespace(a, a_dir, NS)  # its round's .keep lands there too
    step, tiers, sd = _load(a_dir, durable_url=url)
    assert (step, tiers) == (8, ["durable"]) and _equal(sd, _state(8))


def test_flush_on_two_nodes_sends_each_nodes_files_and_the_one_holding_the_set_commits(
        node_dir, agent, tmp_path) -> None:
    """Each agent drains the files its node holds; the one that finds the set complete in the
    durable staging area wins the claim and commits (marker last); the other reports 'partial'."""
    from tests.contract.copy_contract import FILES, memory_tier, save_step
    from tests.contract.copy_contract import NS as COPY_NS
    from tierckpt.tiers import LocalTier

    url = f"file://{tmp_path / 'durable'}"
    names = sorted(FILES)
    dirs = [node_dir("a"), node_dir("b")]
    nodes = [agent(memory_dir=d, node_id=f"node-{i}", durable_url=url, replicas=0) for i, d in enumerate(dirs)]
    for d, name in zip(dirs, names, strict=True):
        save_step(memory_tier(d), 4, held=(name,))
    first = nodes[0].flush(COPY_NS)
    assert first["ok"] and first["drained"][COPY_NS] == {"step": 4, "state": "partial", "files": names[:1]}
    durable = LocalTier(tmp_path / "durable", COPY_NS, name="durable", durable=True)
    assert durable.list_steps() == []
    second = nodes[1].flush(COPY_NS)
    assert second["ok"] and second["drained"][COPY_NS] == {"step": 4, "state": "durable", "files": names[1:]}
    assert verify_copy(durable, 4, COPY_NS).ok
    assert sorted(durable.list_steps()[0].files) == sorted([*FILES, layout.METADATA, layout.MANIFEST, layout.MARKER])


def _metric(text: str, line_start: str) -> float:
    lines = [ln for ln in text.splitlines() if ln.startswith(line_start)]
    assert lines, f"no {line_start} in the metrics"
    return float(lines[0].rsplit(" ", 1)[1])


def test_status_and_metrics_show_steps_replicas_budget_and_lags(node_dir, agent, tmp_path, capsys) -> None:
    from tierckpt.agent.cli import add_arguments, main

    a_dir, b_dir = node_dir("a"), node_dir("b")
    url = f"file://{tmp_path / 'durable'}"
    b = agent(memory_dir=b_dir, node_id="node-b", secret=SECRET, budget_bytes=1 << 30)
    a = agent(memory_dir=a_dir, node_id="node-a", peers=(b.address,), secret=SECRET, durable_url=url)
    _save(a_dir, [1, 2], memory_steps_retained=2)
    wait_for(lambda: 2 in _replica_steps(b_dir, "node-a"), "step 2 replicated to node-b")
    a.tick()  # the replication of step 2 is recorded before the gauges are read
    st = local_request(a_dir, {"op": "status"})
    assert st["namespaces"][NS]["steps"] == [1, 2]
    assert st["namespaces"][NS]["replicated"] == {"step": 2, "to": ["node-b"]}
    assert st["namespaces"][NS]["drain"] == {"newest_memory": 2, "newest_durable": None, "lag_steps": 2}
    assert st["replication_lag_s"] == 0 and st["last_replication"]["to"] == "node-b"
    held = _replica_steps(b_dir, "node-a")  # [2], or [1, 2] when step 1 was sent before step 2 existed
    assert local_request(b_dir, {"op": "status"})["replicas_held"] == {"node-a": {NS: held}}
    metrics = a._agent.metrics.registry.render()
    assert _metric(metrics, 'tierckpt_agent_held_bytes{kind="own"}') > 0
    assert _metric(metrics, "tierckpt_agent_replicated_bytes_total") > 0
    assert _metric(metrics, "tierckpt_agent_replication_bytes_per_second") > 0
    assert _metric(metrics, "tierckpt_agent_replication_lag_namespaces") == 0
    assert _metric(metrics, "tierckpt_agent_replication_lag_seconds") == 0
    assert _metric(metrics, "tierckpt_agent_drain_lag_steps") == 2
    assert "# TYPE tierckpt_agent_fetch_seconds_total counter" in metrics
    a.flush(NS)
    assert _metric(a._agent.metrics.registry.render(), "tierckpt_agent_drain_lag_steps") == 0
    b.tick()
    b_metrics = b._agent.metrics.registry.render()
    assert _metric(b_metrics, 'tierckpt_agent_held_bytes{kind="replica"}') > 0
    assert "# TYPE tierckpt_agent_evictions_total counter" in b_metrics
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert main(parser.parse_args(["status", "--memory-dir", b_dir])) == 0
    out = capsys.readouterr().out
    assert "node node-b" in out and "MiB used of 1024.0 MiB" in out and f"replica of node-a: {NS} steps {held}" in out
    assert main(parser.parse_args(["status", "--memory-dir", a_dir])) == 0
    out = capsys.readouterr().out
    assert f"{NS}: steps [1, 2]; replicas: step 2 on node-b; drain lag 0 steps (newest durable 2)" in out


def test_discovered_peers_replace_the_ones_discovered_before(node_dir, agent) -> None:
    """``set_peers`` (``tierckpt run``'s discovery) keeps the configured ``--peers`` and replaces
    the discovered ones: a node that left the job leaves the list (a lost host drops connections,
    so a peer left there costs each load its whole deadline until a refresh marks it down)."""
    configured = ("10.255.0.1", 7601)
    a = agent(memory_dir=node_dir("a"), node_id="node-a", peers=(configured,), secret=SECRET)
    lost, spare = ("10.255.0.2", 7601), ("10.255.0.3", 7601)
    a.set_peers([lost, a.address])  # its own address is never a peer
    assert a._agent.config.peers == (configured, lost)
    a.set_peers([spare])
    assert a._agent.config.peers == (configured, spare)
    a.set_peers([])
    assert a._agent.config.peers == (configured,)
