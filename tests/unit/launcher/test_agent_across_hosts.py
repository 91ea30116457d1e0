"""The hosted node agent across hosts: on by default for nodes on other hosts, reachable and authenticated.

The decision is pure (argv → options); the secret hand-out runs against a real TCPStore.
"""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from tierckpt.launcher.cli import _agent_across_hosts, _agent_config, build_parser
from tierckpt.launcher.control.jobcontrol import JobControl


def _args(*extra: str) -> object:
    return build_parser().parse_args([*extra, "train.py"])


def _across(*argv: str) -> bool:
    args = _args(*argv)
    agent = _agent_config(args)  # type: ignore[arg-type]
    return agent is not None and _agent_across_hosts(args, agent)  # type: ignore[arg-type]


def test_nodes_on_other_hosts_get_an_agent_on_every_interface_with_a_job_secret(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERCKPT_AGENT_SECRET", raising=False)
    assert _across("--nnodes", "2", "--rdzv-endpoint", "head-node:29400")
    assert _across("--nnodes", "2", "--rdzv-endpoint", "10.0.0.5:29400")
    # one host, or told how to listen / given a secret: as configured
    assert not _across("--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400")
    assert not _across("--nnodes", "2", "--rdzv-endpoint", "localhost:29400")
    assert not _across("--nnodes", "1", "--rdzv-endpoint", "head-node:29400")
    assert not _across("--nnodes", "2", "--rdzv-endpoint", "head-node:29400", "--replicas", "0")
    monkeypatch.setenv("TIERCKPT_AGENT_SECRET", "the job's own")
    assert not _across("--nnodes", "2", "--rdzv-endpoint", "head-node:29400", "--agent-listen", "0.0.0.0:7601",
                       "--memory-dir", "/dev/shm/x")


def test_a_given_secret_without_agent_listen_still_listens_for_other_hosts_with_that_secret(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24 item 7: a secret alone made the hosted agent listen on loopback and publish
    127.0.0.1 to peers on other hosts (no replica could ever arrive). With a secret and no
    --agent-listen, nodes on other hosts get an agent on every interface that keeps the user's
    secret (the generated one is only for jobs that gave none)."""
    monkeypatch.setenv("TIERCKPT_AGENT_SECRET", "the job's own")
    args = _args("--nnodes", "2", "--rdzv-endpoint", "head-node:29400")
    agent = _agent_config(args)  # type: ignore[arg-type]
    assert agent is not None and agent.secret
    assert _agent_across_hosts(args, agent)  # type: ignore[arg-type]
    from tierckpt.launcher.dataplane.host import hosted_agent_config

    listen = hosted_agent_config(agent, across_hosts=True, job_secret=lambda: b"generated")
    assert listen.listen[0] == "0.0.0.0" and listen.secret == agent.secret
    monkeypatch.delenv("TIERCKPT_AGENT_SECRET")
    bare = _agent_config(_args("--nnodes", "2", "--rdzv-endpoint", "head-node:29400"))  # type: ignore[arg-type]
    assert bare is not None
    generated = hosted_agent_config(bare, across_hosts=True, job_secret=lambda: b"generated")
    assert generated.secret == b"generated" and generated.listen[0] == "0.0.0.0"
    assert hosted_agent_config(bare, across_hosts=False, job_secret=lambda: b"x") == bare


def test_every_agent_of_a_job_reads_the_same_generated_secret() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    clients = [dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=10))
               for _ in range(3)]
    secrets = {JobControl(c).job_secret() for c in clients}
    assert len(secrets) == 1
    (secret,) = secrets
    assert len(secret) == 64 and int(secret, 16) > 0  # 32 random bytes, hex
    other = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    assert JobControl(other).job_secret() != secret  # per job (per rendezvous store)


def test_a_new_membership_never_reads_a_lost_nodes_agent_address() -> None:
    """Peer discovery is keyed by the generation the membership formed in: after node 1 was lost,
    the survivor reads no address for node 1 until the node that took its place published one
    (the lost host's address, read under node 1, would stay in its agent's peer list)."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    ctl = JobControl(server)
    ctl.publish_agent(0, 0, "h0", 7601)
    ctl.publish_agent(0, 1, "h1", 7601)
    assert ctl.agents(0, 2) == [("h0", 7601), ("h1", 7601)]
    ctl.publish_agent(3, 0, "h0", 7601)  # the survivor, in the round of generation 3
    assert ctl.agents(3, 2) == [("h0", 7601)]  # not h1's
    assert ctl.agents(3, 2, wait_s=0.2) == [("h0", 7601)]  # a wait that times out returns those found
    ctl.publish_agent(3, 1, "h2", 7601)
    assert ctl.agents(3, 2, wait_s=5.0) == [("h0", 7601), ("h2", 7601)]


def test_agent_insecure_wire_reaches_the_hosted_agent_and_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERCKPT_AGENT_SECRET", raising=False)
    default = _agent_config(_args("--nnodes", "2", "--rdzv-endpoint", "head-node:29400"))  # type: ignore[arg-type]
    assert default is not None and default.insecure_wire is False
    on = _agent_config(_args("--nnodes", "2", "--rdzv-endpoint", "head-node:29400",  # type: ignore[arg-type]
                             "--agent-insecure-wire"))
    assert on is not None and on.insecure_wire is True
