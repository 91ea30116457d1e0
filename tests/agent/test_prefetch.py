"""Prefetch on join, agents in this process on loopback: a replacement node's agent pulls the lost
node's newest state from a peer replica before any load asks; a load that comes while the
prefetch is in flight waits for it instead of fetching the file a second time (a relay with a
bandwidth cap in front of the holder counts the bytes it carried); a prefetch of a damaged
replica leaves nothing usable and the load takes today's path. Plus the pure ``plan``."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

import tierckpt
from tests.agent.conftest import sends_ended, wait_for
from tierckpt import layout
from tierckpt.agent.metrics import LoadWaits, union_seconds
from tierckpt.agent.prefetch import (
    CatalogStep,
    Want,
    namespaces_for,
    parse_ranks,
    plan,
)
from tierckpt.agent.store import NodeStore
from tierckpt.tiers.peer import local_request

NS = "prefetch-run"
SECRET = b"job-secret-prefetch"
DATA = "__0_0.distcp"


def _state(step: int, mib: int = 1) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(mib << 18, generator=g), "step": step}


def _zeros(mib: int = 1) -> dict:
    return {"w": torch.zeros(mib << 18), "step": -1}


def _save(memory_dir: str, steps: list[int], mib: int = 1, **kw) -> None:
    with tierckpt.Checkpointer(tierckpt.CheckpointConfig(namespace=NS, memory_dir=memory_dir, **kw)) as ck:
        for s in steps:
            ck.save(s, _state(s, mib))
        ck.wait()


def _load(memory_dir: str, mib: int = 1, **kw) -> tuple[int | None, list[str], dict]:
    sd = _zeros(mib)
    with tierckpt.Checkpointer(tierckpt.CheckpointConfig(namespace=NS, memory_dir=memory_dir, **kw)) as ck:
        step = ck.load(sd)
        return step, ck.last_load.get("tiers", []), sd


def _replica_steps(memory_dir: str, origin: str) -> list[int]:
    return [s.step for s in NodeStore(memory_dir, "x").replica(origin, NS).list_steps()]


def _lose_node_a(node_dir, agent, *, mib: int = 1, steps=(2, 3), **kw) -> tuple[str, object]:
    """Node a saves and is replicated to b, then is lost (agent closed, memory gone); b's handle."""
    a_dir, b_dir = node_dir("a"), node_dir("b")
    b = agent(memory_dir=b_dir, node_id="node-b", secret=SECRET)
    a = agent(memory_dir=a_dir, node_id="node-a", peers=(b.address,), secret=SECRET)
    _save(a_dir, list(steps), mib, **kw)
    wait_for(lambda: steps[-1] in _replica_steps(b_dir, "node-a"), f"step {steps[-1]} replicated to node-b")
    sends_ended(a, a_dir, NS, ["node-b"])  # close() does not wait for a send's last writes into a_dir
    a.close()
    shutil.rmtree(a_dir)
    return b_dir, b


# ---- the pure choice -------------------------------------------------------------------


def _entry(step: int, held: dict[str, int], every: set[str]) -> CatalogStep:
    return CatalogStep(step, held, frozenset(every))


SMALL = {layout.METADATA: 10, layout.MANIFEST: 5, layout.MARKER: 1}


def test_plan_picks_the_newest_step_the_peers_hold_completely() -> None:
    every = {layout.MANIFEST, layout.MARKER, DATA}  # a manifest lists its data files, not .metadata
    catalog = {4: _entry(4, {**SMALL, DATA: 100}, every),
               5: _entry(5, dict(SMALL), every)}  # step 5's data is on no reachable peer
    assert plan("ns--rank1", catalog, ranks=None, own_newest=None) == Want("ns--rank1", 4, (layout.METADATA, DATA), 110)
    # this node's own memory holds step 4 or newer: its load reads that, nothing to fetch
    assert plan("ns--rank1", catalog, ranks=None, own_newest=4) is None
    assert plan("ns--rank1", {}, ranks=None, own_newest=None) is None


def test_plan_in_global_mode_takes_only_this_nodes_ranks_files() -> None:
    every = {layout.MANIFEST, "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"}
    held = {**SMALL, "__0_0.distcp": 7, "__2_0.distcp": 8, "__3_0.distcp": 9}
    catalog = {9: _entry(9, held, every)}
    assert plan("ns", catalog, ranks={2, 3}, own_newest=None) == \
        Want("ns", 9, (layout.METADATA, "__2_0.distcp", "__3_0.distcp"), 27)
    assert plan("ns", catalog, ranks={1}, own_newest=None) is None  # rank 1's file is on no peer
    assert plan("ns", catalog, ranks={5}, own_newest=None) is None  # rank 5 saved nothing here
    assert namespaces_for("ns", [2, 3]) == [("ns--rank2", 2), ("ns--rank3", 3), ("ns", None)]


def test_load_waits_count_overlapping_requests_once() -> None:
    assert union_seconds([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]) == pytest.approx(4.0)
    assert union_seconds([]) == 0.0
    waits = LoadWaits(kept=2)
    waits.note("a/step_1", "x", 0.0, 1.0)
    waits.note("a/step_1", "y", 0.5, 3.0)
    assert waits.view()["a/step_1"] == {"seconds": 3.0, "files": 2, "slowest": "y", "slowest_s": 2.5}
    waits.note("a/step_2", "x", 0.0, 1.0)
    waits.note("a/step_3", "x", 0.0, 1.0)
    assert list(waits.view()) == ["a/step_2", "a/step_3"]  # the newest steps are kept


def test_a_local_prefetch_request_checks_its_ranks() -> None:
    assert parse_ranks([3, 2, 3]) == (3, 2)
    for bad in ([], [-1], [True], ["1"], "1", [1.0], list(range(5000))):
        with pytest.raises(ValueError):
            parse_ranks(bad)


# ---- agents on loopback ------------------------------------------------------------------


def test_replacement_prefetches_the_lost_nodes_step_and_the_load_reads_it_bitwise(node_dir, agent) -> None:
    _, b = _lose_node_a(node_dir, agent)
    c_dir = node_dir("c")  # the replacement: a new node id, an empty memory root
    c = agent(memory_dir=c_dir, node_id="node-c", peers=(b.address,), secret=SECRET)
    job = c.prefetch(NS, [0])
    assert job.wait(30) and job.ok, job.summary()
    assert job.results[NS]["step"] == 3 and job.results[NS]["files"] == [layout.METADATA, DATA, "__0_1.distcp"]
    cached = Path(c_dir, layout.PEER_CACHE, NS, "step_3")
    assert sum((cached / n).stat().st_size for n in job.results[NS]["files"]) == job.results[NS]["bytes"]
    fetched = c._agent.metrics.fetched_bytes.value()
    step, tiers, sd = _load(c_dir)
    assert (step, tiers) == (3, ["peer"])
    assert torch.equal(sd["w"], _state(3)["w"]) and sd["step"] == 3
    assert c._agent.metrics.fetched_bytes.value() == fetched  # the load fetched nothing again
    waits = c.status()["load_waits"][f"{NS}/step_3"]
    assert waits["files"] >= 2 and waits["seconds"] < 5, waits  # .metadata and the data files, from the cache
    assert c.status()["last_prefetch"]["ok"] is True
    # a node whose own memory holds the step (a survivor) fetches nothing
    again = agent(memory_dir=node_dir("d"), node_id="node-d", peers=(b.address,), secret=SECRET)
    _save(again.config.memory_dir, [3])
    job = again.prefetch(NS, [0])
    assert job.wait(30) and job.ok and job.results == {}


class _Relay:
    """A TCP relay in front of a holder that carries its replies at ``rate`` bytes/s (a slow link)
    and counts them."""

    def __init__(self, target: tuple[str, int], rate: float) -> None:
        self.target, self.rate = target, rate
        self.carried = 0
        self._lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()[:2]
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, slow: bool) -> None:
        try:
            while chunk := src.recv(64 << 10):
                dst.sendall(chunk)
                if slow:
                    with self._lock:
                        self.carried += len(chunk)
                    time.sleep(len(chunk) / self.rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
        for s in self._conns:
            s.close()


def test_a_load_during_the_prefetch_waits_for_it_and_the_file_crosses_the_link_once(node_dir, agent) -> None:
    mib = 8
    _, b = _lose_node_a(node_dir, agent, mib=mib, steps=(3,))
    relay = _Relay(b.address, rate=4e6)  # ~2 s for the 8 MiB file
    try:
        c_dir = node_dir("c")
        c = agent(memory_dir=c_dir, node_id="node-c", peers=(relay.address,), secret=SECRET)
        job = c.prefetch(NS, [0])
        staging = Path(c_dir, layout.PEER_CACHE, NS, layout.STAGING)
        wait_for(lambda: staging.is_dir() and any(f".{DATA}." in f.name for f in staging.iterdir()),
                 "the prefetch receiving the data file")
        assert not job.done.is_set() and c._agent.restoring()
        # a survivor's replication to the restoring node waits until the restore is done
        d_dir = node_dir("d")
        d = agent(memory_dir=d_dir, node_id="node-d", peers=(c.address,), secret=SECRET)
        _save(d_dir, [5])
        wait_for(lambda: d._agent.metrics.replication_failures.value() >= 1, "a put refused during the restore")
        assert not job.done.is_set() and _replica_steps(c_dir, "node-d") == []
        t_load = time.time()
        t0 = time.monotonic()
        step, tiers, sd = _load(c_dir, mib)
        waited = time.monotonic() - t0
        assert job.done.is_set() and job.ok, job.summary()
        assert (step, tiers) == (3, ["peer"]) and torch.equal(sd["w"], _state(3, mib)["w"])
        size = Path(c_dir, layout.PEER_CACHE, NS, "step_3", DATA).stat().st_size
        assert job.finished is not None and job.finished > t_load  # the load came while the prefetch was in flight
        assert c.status()["load_waits"][f"{NS}/step_3"]["slowest"] == DATA  # it waited for the data file
        # the data file crossed the link once: the load's own requests carried only listings
        assert relay.carried < size * 1.5, (relay.carried, size)
        assert c._agent.metrics.fetched_bytes.value() < size * 1.5
        wait_for(lambda: _replica_steps(c_dir, "node-d") == [5], "the replica once the restore is done")
        print(f"\nload during the prefetch waited {waited:.2f}s; relay carried {relay.carried} bytes for {size}")
    finally:
        relay.close()


def test_a_prefetch_of_a_damaged_replica_leaves_nothing_and_the_load_uses_durable(node_dir, agent, tmp_path) -> None:
    durable = f"file://{tmp_path / 'durable'}"
    b_dir, b = _lose_node_a(node_dir, agent, steps=(4,), durable_url=durable, durable_every_n_steps=1)
    path = Path(b_dir, layout.REPLICAS, "node-a", NS, "step_4", DATA)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    c_dir = node_dir("c")
    c = agent(memory_dir=c_dir, node_id="node-c", peers=(b.address,), secret=SECRET)
    job = c.prefetch(NS, [0])
    assert job.wait(30) and not job.ok
    # the holder checks each item while sending and stops at the bad one: the file never arrives whole
    assert DATA in job.results[NS]["error"], job.results
    assert not Path(c_dir, layout.PEER_CACHE, NS, "step_4", DATA).exists()  # never a torn or unverified file
    step, tiers, sd = _load(c_dir, durable_url=durable)
    assert step == 4 and "durable" in tiers and torch.equal(sd["w"], _state(4)["w"])


def test_a_catalog_skips_a_peer_that_did_not_answer_the_last_refresh(node_dir, agent) -> None:
    """A lost host's agent (here: a port that accepts and never answers) cost every load's catalog
    the whole peer deadline; now only the background refresh waits for it."""
    from tierckpt.agent.config import AgentLimits

    _, b = _lose_node_a(node_dir, agent)
    stuck = socket.create_server(("127.0.0.1", 0))  # connects succeed, nothing is ever said
    try:
        c_dir = node_dir("c")
        c = agent(memory_dir=c_dir, node_id="node-c", peers=(stuck.getsockname()[:2], b.address), secret=SECRET,
                  limits=AgentLimits(peer_deadline_s=3.0))
        wait_for(lambda: c._agent.peers_down, "the refresh to give up on the stuck peer")
        t0 = time.monotonic()
        reply = local_request(c_dir, {"op": "catalog", "ns": NS}, timeout=30)
        assert time.monotonic() - t0 < 2.0  # not the 3 s deadline
        assert 3 in [s["step"] for s in reply["steps"]]  # b's replica is listed
    finally:
        stuck.close()


def test_the_local_socket_starts_a_prefetch_and_refuses_bad_ranks(node_dir, agent) -> None:
    _, b = _lose_node_a(node_dir, agent)
    c_dir = node_dir("c")
    c = agent(memory_dir=c_dir, node_id="node-c", peers=(b.address,), secret=SECRET)
    bad = local_request(c_dir, {"op": "prefetch", "ns": NS, "ranks": [-3]}, timeout=10)
    assert not bad.get("ok") and "rank" in str(bad.get("error")), bad
    reply = local_request(c_dir, {"op": "prefetch", "ns": NS, "ranks": [0]}, timeout=10)
    assert reply["ok"]
    wait_for(lambda: c.status()["last_prefetch"].get("finished"), "the prefetch to finish")
    assert c.status()["last_prefetch"]["ok"] and Path(c_dir, layout.PEER_CACHE, NS, "step_3", DATA).exists()
