"""Which node serves the job's store, so that its loss blames that node (``LostStore``).

torch's handlers decide which agent serves the store (``is_host`` in ``--rdzv-conf``, else the
endpoint's host name); the agent that finds its own socket listening on the store's port
(``control.store.hosted_here``) writes its identity (``keys.STORE_HOST``) before each join barrier,
and every agent reads it after the barrier, while the store is up. When the store is lost
(``Liveness``'s ``on_store_lost``), the identity maps to a group rank through the round's
membership (``Rounds.members``): the node the fault names. A store served from outside the job
(a standalone TCPStore, etcd) names no node.

Call order (the supervisor, each round):

    watch.offer(job_store, identity)    # before the join barrier
    watch.learn(job_store)              # after it
    watch.node(members)                 # when the store is lost: the group rank, or None
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tierckpt.launcher.control import keys
from tierckpt.launcher.control.store import hosted_here, peek

__all__ = ["StoreWatch"]


class StoreWatch:
    def __init__(self) -> None:
        self.identity: str | None = None  # the identity of the agent serving the store, as last read
        self.here = False

    def offer(self, job_store: Any, identity: str) -> None:
        """This agent serves ``job_store``: say so, under its identity."""
        self.here = hosted_here(int(job_store.port))
        if self.here:
            job_store.set(keys.STORE_HOST, identity.encode())

    def learn(self, job_store: Any) -> None:
        raw = peek(job_store, keys.STORE_HOST)
        self.identity = raw.decode() if raw is not None else None

    def node(self, members: Mapping[int, str]) -> int | None:
        """The group rank the store's agent holds in ``members`` (None: not a member, or unknown)."""
        return next((rank for rank, ident in members.items() if ident == self.identity), None)
