"""Which node serves the job's store (supervisor/storeloss.py, control/store.hosted_here), on real
TCPStores: the serving agent says so before the join barrier, every agent reads it, and a lost
store names that node's group rank."""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from tierckpt.launcher.control.store import hosted_here
from tierckpt.launcher.supervisor.storeloss import StoreWatch

from .conftest import client


def test_only_the_process_that_serves_a_store_finds_it_listening(server: Any) -> None:
    assert hosted_here(int(server.port))
    other = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=False,  # type: ignore[attr-defined]
                          timeout=datetime.timedelta(seconds=5))
    assert hosted_here(int(other.port))  # torch's legacy server too
    client(server)  # a client of it in this process: its socket connects, it does not listen
    assert not hosted_here(1)  # tcpmux: nobody listens there


def test_the_serving_agent_is_named_by_every_agent() -> None:
    """The server's process offers its identity; an agent on a client of a store served elsewhere
    (here: a store whose port no socket of this process listens on, through a forwarding client)
    offers nothing; both read the server's identity and map it to its group rank."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,  # type: ignore[attr-defined]
                           timeout=datetime.timedelta(seconds=5))
    host, other = StoreWatch(), StoreWatch()
    host.offer(server, "h0:/dev/shm/tierckpt")
    other.offer(_Elsewhere(client(server)), "h1:/dev/shm/tierckpt")
    assert host.here and not other.here
    for w in (host, other):
        w.learn(server)
        assert w.identity == "h0:/dev/shm/tierckpt"
        assert w.node({0: "h1:/dev/shm/tierckpt", 1: "h0:/dev/shm/tierckpt"}) == 1
        assert w.node({0: "h1:/dev/shm/tierckpt"}) is None  # the serving agent is no member (a spare)


def test_a_store_served_outside_the_job_names_no_node(server: Any) -> None:
    w = StoreWatch()
    w.learn(server)
    assert w.identity is None and w.node({0: "h0:/m"}) is None


class _Elsewhere:
    """A client whose store looks served by another machine: its port is one nobody here listens on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.port = 1  # tcpmux: nothing listens there

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
