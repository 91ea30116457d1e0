"""The launcher's half of the node agent (launcher/dataplane/host.py): peer discovery through a
real TCPStore on 127.0.0.1 (two hosts, as two nodes' launchers), and hosting a real node agent.
The agents in the discovery test are stand-ins with the two attributes discovery uses (an address,
``set_peers``): hosting two real agents is the hosting test's, and the scenarios'."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch.distributed as dist

from tierckpt.launcher.control.jobcontrol import JobControl
from tierckpt.launcher.control.store import connect_client
from tierckpt.launcher.dataplane.host import NodeAgentHost, local_address
from tierckpt.launcher.events import Events


class _Agent:
    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.peers: list[list[tuple[str, int]]] = []

    def set_peers(self, peers: list[tuple[str, int]]) -> None:
        self.peers.append(list(peers))


def test_each_node_publishes_its_agent_and_learns_the_others_once_per_membership(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))  # type: ignore[attr-defined]
    ctls = [JobControl(store), JobControl(connect_client("127.0.0.1", store.port))]
    hosts = [NodeAgentHost(None, Events(None, node=n), across_hosts=True) for n in (0, 1)]
    agents = [_Agent(("0.0.0.0", 7601)), _Agent(("10.0.0.2", 7601))]
    for n, h in enumerate(hosts):
        h.agent = agents[n]
        h.follow(3, n, 2)
    hosts[0].discover(ctls[0], lambda: "10.0.0.1")  # node 1 has not published yet
    assert agents[0].peers == [[]]
    hosts[1].discover(ctls[1], lambda: "unused", wait_s=5.0)  # node 0 did: both known to node 1
    assert agents[1].peers == [[("10.0.0.1", 7601)]]  # 0.0.0.0 is published as the node's own address
    hosts[0].discover(ctls[0], lambda: "10.0.0.1")  # within a second: rate-limited, nothing read
    assert agents[0].peers == [[]]
    hosts[0]._next = 0.0  # a second later
    hosts[0].discover(ctls[0], lambda: "10.0.0.1")
    assert agents[0].peers[-1] == [("10.0.0.2", 7601)]
    hosts[0]._next = 0.0
    hosts[1].follow(5, 1, 2)  # a new membership (generation 5): published again, under its own key
    hosts[1].discover(ctls[1], lambda: "unused")
    assert agents[1].peers[-1] == []  # node 0 has not published for membership 5 yet
    assert local_address("127.0.0.1") == "127.0.0.1" and local_address("localhost") == "127.0.0.1"


def test_it_hosts_a_node_agent_unless_one_serves_the_memory_dir(tmp_path: Path) -> None:
    from tierckpt.agent import AgentConfig

    events = tmp_path / "events.jsonl"
    cfg = AgentConfig(memory_dir=str(tmp_path / "mem"), listen=("127.0.0.1", 0))
    ev1, ev2 = Events(str(events), node=0), Events(str(events), node=0)
    first = NodeAgentHost(cfg, ev1, across_hosts=False)
    second = NodeAgentHost(cfg, ev2, across_hosts=False)
    try:
        first.start(0, lambda: b"unused")
        assert first.agent is not None and first.flush() is not None
        second.start(0, lambda: b"unused")
        assert second.agent is None and second.flush() is None
        seen = [json.loads(line) for line in events.read_text().splitlines()]
        assert [e["event"] for e in seen] == ["agent", "warning"], seen
        assert "already serves" in seen[1]["what"]
        assert NodeAgentHost(None, Events(None, node=0), across_hosts=False).flush() is None
    finally:
        first.close()
        second.close()
        ev1.close()
        ev2.close()
    assert first.agent is None




def test_two_launchers_starting_at_once_on_one_memory_dir_host_one_agent(tmp_path: Path, monkeypatch) -> None:
    """The race the shared-memory-dir scenario lost in CI: both launchers asked "does an agent
    serve this dir?" before either had bound its socket, so both went on to host one, and the
    second's socket found the first's and ended the launcher (exit 70). The probe is made to miss
    here (patched to answer "no agent", what it answered a few milliseconds before the first
    agent bound): the second launcher must then take the first's agent as its own, without error,
    and leave no listener of its own behind."""
    from tierckpt.agent import AgentConfig, start_agent
    from tierckpt.errors import AgentRunningError, StorageError, TierckptError
    from tierckpt.tiers import peer

    cfg = AgentConfig(memory_dir=str(tmp_path / "mem"), listen=("127.0.0.1", 0))
    events = tmp_path / "events.jsonl"
    ev = Events(str(events), node=1)
    first = start_agent(cfg)
    second = NodeAgentHost(cfg, ev, across_hosts=False)
    try:
        before = {c.laddr.port for c in _listeners()}

        def missed(*_a: object, **_k: object) -> None:
            raise StorageError("no agent answers (yet)")

        monkeypatch.setattr(peer, "local_request", missed)
        second.start(0, lambda: b"unused")
        assert second.agent is None
        seen = [json.loads(line) for line in events.read_text().splitlines()]
        assert [e["event"] for e in seen] == ["warning"], seen
        assert "already serves" in seen[0]["what"]
        assert {c.laddr.port for c in _listeners()} == before  # the second agent's peer port closed again
        monkeypatch.undo()
        assert peer.local_request(cfg.memory_dir, {"op": "status"}, timeout=2.0)  # the first one still serves
        try:
            start_agent(cfg)
        except AgentRunningError as e:  # typed, under the one root
            assert isinstance(e, TierckptError) and str(cfg.memory_dir) in str(e)
        else:
            raise AssertionError("a second agent on a served memory dir started")
    finally:
        second.close()
        first.close()
        ev.close()


def _listeners() -> list:
    import psutil

    return [c for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN]
