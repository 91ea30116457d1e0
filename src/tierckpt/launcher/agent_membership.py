"""The membership and spares path of ``TierckptAgent`` (agent.py), moved out of agent.py as is:
the survivors' regroup after a lost node, a node's arrival below MAX, the spare gate, and a
repeat offender standing aside for a spare (avoid.py). A mixin of the agent's own methods; the
attributes and methods of the agent it uses are declared below for the type checker.

Call order (``TierckptAgent``; see agent.py's module doc):

    _join           -> _spare_gate (-> _standing_by)          # before torch's rendezvous
    _detect         -> _arrived                               # every poll: a MembershipChange
    _recover        -> _keep_out; then _stand_aside (the offender) or _regroup (-> _lost_nodes)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from tierckpt.launcher import ranks
from tierckpt.launcher.avoid import KeepOut, RepeatOffenders, leave_round
from tierckpt.launcher.control import JobControl, Liveness, connect_client
from tierckpt.launcher.events import Events
from tierckpt.launcher.membership import MEMBERSHIP_CHANGE, Change, shrink
from tierckpt.launcher.options import RunOptions
from tierckpt.launcher.seats import FirstSeats, SeatBeat
from tierckpt.launcher.spares import JobEnded, SpareGate, arrivals, spares_waiting
from tierckpt.launcher.warm import StandbyPool

__all__ = ["MembershipPath"]


class MembershipPath:
    """``TierckptAgent``'s membership and spares methods; see the module doc."""

    opts: RunOptions
    events: Events
    generation: int
    _worker_group: WorkerGroup
    _members: dict[int, str]
    _change: Change
    _ctl: JobControl | None
    _liveness: Liveness | None
    _arrivals_seen: int
    _held_rank: int | None
    _pool: StandbyPool | None
    _avoid: RepeatOffenders
    _seat_beat: SeatBeat | None
    _aside: bool  # this agent stands aside as a repeat offender: other waiting spares take seats first

    if TYPE_CHECKING:  # the agent's (agent.py)
        @property
        def ctl(self) -> JobControl: ...

        @property
        def node(self) -> int: ...

        @property
        def nnodes(self) -> int: ...

        def _join(self) -> None: ...

        def _ended(self, exc: JobEnded) -> RunResult: ...

        def _settle(self, job_store: Any, *, spare_since: float | None, via: str) -> None: ...

    def _regroup(self, fault: dict[str, Any], g: int) -> bool:
        """An elastic job that lost nodes and keeps at least MIN: the survivors agree on the next
        membership through the store (``JobControl.regroup``), without a torch rendezvous round;
        False (use the round) when ``membership.shrink`` says so or a survivor does not arrive."""
        el, ctl, wg = self.opts.elastic, self.ctl, self._worker_group
        if el is None or not el.elastic or fault.get("reason") == MEMBERSHIP_CHANGE:
            return False
        lost = self._lost_nodes(fault)
        plan = shrink(nnodes=self.nnodes, lost=lost, elastic=el,
                      spares_waiting=spares_waiting(ctl.store) + wg.spec.rdzv_handler.num_nodes_waiting())
        got = ctl.regroup(g, self.node, list(plan.survivors), timeout=self.opts.node_timeout_s) \
            if plan.regroup and self.node in plan.survivors else None
        if got is None:
            return False
        rank, world = got
        import torch.distributed as dist

        round_store = dist.PrefixStore(f"tierckpt/run/regroup/{g}/", ctl.store)  # type: ignore[attr-defined]
        wg.workers = LocalElasticAgent._assign_worker_ranks(self, round_store, rank, world, wg.spec)
        wg.store, wg.group_rank, wg.group_world_size = round_store, rank, world  # type: ignore[assignment]
        after = {new: self._members.get(old, "") for new, old in enumerate(plan.survivors)}
        self._change, self._members = Change(before=self._members, after=after), after
        self.generation = g + 1
        self._settle(ctl.store, spare_since=None, via="regroup")
        return True

    def _arrived(self) -> bool:
        """An agent passed the spare gate into a job below its maximum since this round settled
        (spares.arrivals: one store operation a poll, only while the job runs below MAX)."""
        el, ctl = self.opts.elastic, self._ctl
        if el is None or ctl is None or self.nnodes >= el.max_nodes:
            return False
        return arrivals(ctl.store) > self._arrivals_seen

    def _lost_nodes(self, fault: dict[str, Any]) -> list[int]:
        """The group ranks a re-rendezvous lacks: a LostNode claim's, else (a machine gone with its
        reaper shows first as the survivors' Crash) the liveness verdict's, awaited up to
        ``--node-timeout`` (every survivor reads the same verdict key)."""
        if fault.get("reason") == "LostNode":
            return [int(n) for n in fault.get("lost") or [fault.get("node")] if n is not None]
        deadline = time.monotonic() + self.opts.node_timeout_s
        while self._liveness is not None:
            lost = self._liveness.lost()
            if lost or time.monotonic() > deadline:
                return sorted(lost)
            time.sleep(0.05)
        return []

    def _spare_gate(self) -> float | None:
        """spares.SpareGate before torch's rendezvous; when this agent began standing by, or None.
        A survivor (it held a rank in this process) never waits there. Before the first round
        formed, the gate seats this agent in it or holds it as a spare (seats.py); the seat's
        beat runs until the round formed (group rank 0 published its node count)."""
        if self._held_rank is not None:
            return None
        handler = self._worker_group.spec.rdzv_handler
        store = getattr(handler, "_store", None)
        max_nodes = getattr(getattr(handler, "_settings", None), "max_nodes", None)
        if store is None or not isinstance(max_nodes, int):
            return None
        job_store = getattr(store, "underlying_store", store)
        host, port = getattr(job_store, "host", None), getattr(job_store, "port", None)
        seats = FirstSeats(ranks.identity(self.opts.memory_dir), stale_s=self.opts.node_timeout_s,
                           connect=lambda: connect_client(str(host), int(port))) \
            if isinstance(host, str) and isinstance(port, int) else None
        pool = self._pool
        gate = SpareGate(job_store, max_nodes, self._standing_by,
                         ready=lambda: pool is None or pool.workers_ready(),
                         on_warm=lambda: self._standing_by(None), seats=seats, offender=self._aside)
        try:
            return gate.wait()
        finally:
            if gate.beat is not None:
                self._seat_beat = gate.beat

    def _standing_by(self, job_nodes: int | None) -> None:
        """This agent stands by as a spare (``job_nodes``: the job's nodes), or its standbys just
        finished their imports (None): ``spare`` events ``standby`` and ``warm``."""
        fields: dict[str, Any] = {"state": "warm"} if job_nodes is None else {"state": "standby", "job_nodes": job_nodes}
        self.events.emit("spare", generation=self.generation, identity=ranks.identity(self.opts.memory_dir), **fields)

    def _keep_out(self, fault: dict[str, Any], g: int) -> KeepOut:
        """The repeat offenders the next round does without (the same on every node), reported
        as ``offender`` events; the waiting spares take their ranks."""
        out = self._avoid.keep_out(self.ctl.store, g, fault, self._members, spares=spares_waiting(self.ctl.store))
        for rank, ident in zip(out.ranks, out.identities, strict=True):
            self.events.emit("offender", generation=g, node=rank, identity=ident, faults=self._avoid.count(ident),
                             spares=out.spares, max_avoid=self._avoid.policy.max_avoid,
                             window_s=self._avoid.policy.window_s)
        return out

    def _stand_aside(self, g: int) -> RunResult | None:
        """This node is a repeat offender: out of torch's round, and to the spare gate as a node
        that holds no rank, behind every other spare waiting there (``SpareGate(offender=True)``);
        None when a seat opens for it again, a RunResult when the job ended."""
        leave_round(self._worker_group.spec.rdzv_handler)
        self._held_rank = None
        self._aside = True
        try:
            self._join()
        except JobEnded as exc:
            return self._ended(exc)
        finally:
            self._aside = False
        return None
