"""The job's control plane on the rendezvous store: one generation, fault claims, stop barrier, liveness.

Every key lives under ``tierckpt/run/`` of the c10d rendezvous TCPStore (the store torch's
agents already share), so there is no second server; keys.py names them. Call order, on every agent:

    ctl = JobControl(job_store)
    g = ctl.join(round_store, nnodes, local_next=..., local_full=...)  # after each rendezvous round
    ...when woken or due:   rec = ctl.claimed(g)                       # a fault anywhere in generation g
                            # (claimwatch.py: a thread blocked in wait_claim wakes the loop)
    ...on a local fault:    rec = ctl.claim(g, record)                 # first claim wins; returns the winner
    ...after stopping:      ctl.stopped(g); ctl.wait_stopped(g, nnodes, timeout)
    ...master of g + 1:     ctl.publish_master(g + 1, addr, port) / ctl.master(g + 1, timeout)
    ...after a lost node:   ctl.regroup(g, node, survivors, timeout)  # survivors only, instead of a round

The generation is job-wide and monotonic: a claim for generation g moves the stored
generation to g + 1, and every agent starts g + 1 after the stop barrier, so two agents can
never run workers of different generations (pytorch#135712). Workers of each generation meet
on a fresh TCPStore port published here, so no key of an older generation is ever read.
``Liveness`` (liveness.py) runs in a thread with its own store client and reports agents whose
beat stopped moving.

Store cost: nothing here polls a counter or reads another agent's key. A claim is one key and
its wake-up key; ``wait_claim`` blocks on the latter without traffic and the agent reads the
claim once a second besides (claimwatch.py); the barriers (``join``, ``wait_stopped``) are one
``add`` per agent, and the agent that completes the count sets one key that the others wait on;
``master`` is a wait on one key.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from tierckpt.launcher.control import keys
from tierckpt.launcher.control.liveness import Liveness
from tierckpt.launcher.control.store import peek, timeout_error

__all__ = ["JobControl", "Liveness"]


class JobControl:
    """Reads and writes the job-wide keys; every method is one or a few store round trips."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def _raise_to(self, key: str, value: int) -> int:
        """Set ``key`` to max(current, value) atomically; return the result."""
        while True:
            cur_raw = self.store.get(key) if self.store.check([key]) else None
            cur = int(cur_raw) if cur_raw is not None else None
            if cur is not None and cur >= value:
                return cur
            expected = b"" if cur_raw is None else cur_raw
            got = self.store.compare_set(key, expected, str(value).encode())
            if int(got) >= value:
                return int(got)

    def agree_max(self, key: str, value: int) -> int:
        """Raise the job-wide counter ``key`` (``keys.MEMBERSHIP_CHANGES``, ...) to at least ``value``;
        the agreed value (every agent offers its own after a rendezvous round, and the highest any
        node remembers wins)."""
        return self._raise_to(key, value)

    def get_int(self, key: str, default: int = 0) -> int:
        return int(self.store.get(key)) if self.store.check([key]) else default

    def join(self, round_store: Any, nnodes: int, *, local_next: int, local_full: int,
             timeout: float = 600.0) -> tuple[int, int]:
        """Agree on (generation, full restarts) after a rendezvous round; blocks until all joined."""
        self._raise_to(keys.GENERATION, local_next)
        self._raise_to(keys.FULL_RESTARTS, local_full)
        round_store.add(keys.JOINED, 1)
        if not _reached(round_store, keys.JOINED, nnodes, timeout):
            raise TimeoutError(f"not every agent joined within {timeout:.0f}s")
        return self.get_int(keys.GENERATION), self.get_int(keys.FULL_RESTARTS)

    def claimed(self, generation: int) -> dict[str, Any] | None:
        """The claim of ``generation``, if any: one store operation that never blocks."""
        raw = peek(self.store, keys.fault(generation))
        return None if raw is None else dict(json.loads(raw))

    def wait_claim(self, generation: int, timeout: float) -> dict[str, Any] | None:
        """Block until ``generation`` is claimed (the store wakes the waiter; no polling), or None.

        It waits on the key every claimer ``set``s after its ``compare_set``: torch's legacy
        TCPStore server (``use_libuv=False``) does not wake waiters on a ``compare_set`` (the libuv
        one does), so a wait on the claim key itself would sleep out its timeout there."""
        if not self.wait_claim_key(generation, timeout):
            return None
        return self.claimed(generation)

    def wait_claim_key(self, generation: int, timeout: float) -> bool:
        """Block until the wake-up key of ``generation``'s claim is set (True) or ``timeout`` (False).
        A claim sets it, and so does ``release_claim_waiters`` with no claim behind it."""
        try:
            self.store.wait([keys.fault_set(generation)], datetime.timedelta(seconds=max(timeout, 0.001)))
        except timeout_error():
            return False
        return True

    def release_claim_waiters(self, generation: int) -> None:
        """End every wait on ``generation``'s wake-up key without a claim: an agent that leaves
        ends its own claim watch this way (a thread blocked in a C++ store wait while the
        interpreter exits aborts the process when the store closes the connection). Waiters of
        other agents wake to no claim and read the key every tick for the rest of ``generation``."""
        self.store.set(keys.fault_set(generation), b"")

    def claim(self, generation: int, record: dict[str, Any]) -> dict[str, Any]:
        """Report a fault of ``generation``; the first claim wins and is returned to everyone."""
        got = self.store.compare_set(keys.fault(generation), b"", json.dumps(record).encode())
        self.store.set(keys.fault_set(generation), b"1")  # wakes ``wait_claim`` on either store server
        self._raise_to(keys.GENERATION, generation + 1)
        return dict(json.loads(got))

    def history(self, generation: int) -> list[dict[str, Any]]:
        """Every claimed fault of generations 0..generation, oldest first."""
        out = []
        for g in range(generation + 1):
            rec = self.claimed(g)
            if rec is not None:
                out.append(rec)
        return out

    def stopped(self, generation: int) -> None:
        self.store.add(keys.stopped(generation), 1)

    def stopped_count(self, generation: int) -> int:
        """How many agents acked the stop barrier of ``generation`` so far (never blocks)."""
        return int(self.store.add(keys.stopped(generation), 0))

    def wait_stopped(self, generation: int, nnodes: int, timeout: float) -> bool:
        """True when every agent stopped its workers of ``generation`` within ``timeout``."""
        return _reached(self.store, keys.stopped(generation), nnodes, timeout)

    def regroup(self, generation: int, node: int, survivors: list[int], timeout: float) -> tuple[int, int] | None:
        """After a lost node, the survivors agree on the next membership without a rendezvous round.

        ``survivors`` is the same list on every survivor (the group ranks not in the claim's lost
        set); the new group rank is this node's place in it. One ``add`` each and a wait on one
        key; None when not every survivor arrived within ``timeout`` (another node is gone too:
        fall back to the rendezvous), or when ``node`` is not a survivor (the verdict counted it
        lost while it still runs: it must not take a survivor's place in the count). The agent
        calls it for a shrink of an elastic job (``membership.shrink``); ``bench scale``
        measures it against torch's handler.
        """
        order = sorted(survivors)
        if node not in order:
            return None
        key = keys.regroup(generation)
        self.store.add(key, 1)
        if not _reached(self.store, key, len(order), timeout):
            return None
        return order.index(node), len(order)

    def publish_master(self, generation: int, addr: str, port: int) -> None:
        self.store.set(keys.master(generation), f"{addr}:{port}".encode())

    def master(self, generation: int, timeout: float) -> tuple[str, int]:
        key = keys.master(generation)
        try:
            self.store.wait([key], datetime.timedelta(seconds=timeout))
        except timeout_error() as exc:
            raise TimeoutError(f"the master address of generation {generation} was not published") from exc
        addr, _, port = self.store.get(key).decode().rpartition(":")
        return addr, int(port)

    def set_progress(self, generation: int, node: int, step: int) -> None:
        self.store.set(keys.progress(generation, node), str(step).encode())

    def job_secret(self) -> bytes:
        """The job's node-agent secret: the first agent to ask generates it (``compare_set``), every
        later one reads the same; only for agents given no secret of their own (``--agent-secret-file``)."""
        import secrets

        return bytes(self.store.compare_set(keys.AGENT_SECRET, "", secrets.token_hex(32)))

    def publish_agent(self, membership: int, node: int, host: str, port: int) -> None:
        """This node's hosted node agent listens on ``host:port`` (peer discovery), as node ``node``
        of the membership that formed in generation ``membership`` (a round's or a regroup's)."""
        self.store.set(keys.agent(membership, node), f"{host}:{port}".encode())

    def agents(self, membership: int, nnodes: int, wait_s: float = 0.0) -> list[tuple[str, int]]:
        """The node agents published so far by nodes ``0 .. nnodes-1`` of the membership formed in
        generation ``membership``, after waiting up to ``wait_s`` for all of them (0: never blocks;
        right after a round every node publishes at once, so a wait is short). Keyed by membership, not by node alone: after a
        lost node the survivors would otherwise read its address under its old node number until
        the node that took it published, and keep it (seen on namespaced hosts, where a lost
        host's address drops connections for the agent's whole peer deadline)."""
        published = [keys.agent(membership, node) for node in range(nnodes)]
        if wait_s > 0:
            try:
                self.store.wait(published, datetime.timedelta(seconds=wait_s))
            except timeout_error():
                pass  # a node without a hosted agent: go on with those found
        found = []
        for key in published:
            if self.store.check([key]):
                host, _, port = self.store.get(key).decode().rpartition(":")
                found.append((host, int(port)))
        return found

    def mark_done(self, node: int) -> None:
        self.store.set(keys.done(node), b"1")


def _reached(store: Any, key: str, n: int, timeout: float) -> bool:
    """Wait until the counter ``key`` reaches ``n`` without polling it: the agent that reads
    ``n`` sets ``key/done`` and every other one waits on that one key (one wake-up each)."""
    done = keys.counter_done(key)
    if int(store.add(key, 0)) >= n:
        store.set(done, b"1")
        return True
    try:
        store.wait([done], datetime.timedelta(seconds=max(timeout, 0.001)))
    except timeout_error():
        return int(store.add(key, 0)) >= n
    return True
