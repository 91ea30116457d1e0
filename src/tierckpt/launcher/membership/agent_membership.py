"""The membership and spares path of ``TierckptAgent`` (supervisor/torch_agent.py), moved out of it as is:
the survivors' regroup after a lost node, a node's arrival below MAX, the spare gate, and a
repeat offender standing aside for a spare (avoid.py). A mixin of the agent's own methods; the
attributes and methods of the agent it uses are declared below for the type checker.

Call order (``TierckptAgent``; see torch_agent.py's module doc):

    _join           -> _spare_gate (-> _standing_by)          # before torch's rendezvous
    _detect         -> _arrived                               # every poll: a MembershipChange
    _recover        -> _keep_out; then _stand_aside (the offender) or _regroup (-> _lost_nodes)
    _join           -> _avoid_after_round                     # after each rendezvous round
    _finish         -> _avoid_at_full_restart                 # a FULL_RESTART decision, before the exit barrier
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from tierckpt.launcher.control import keys
from tierckpt.launcher.control.jobcontrol import JobControl, Liveness
from tierckpt.launcher.control.store import connect_client
from tierckpt.launcher.events import Events
from tierckpt.launcher.membership import ranks
from tierckpt.launcher.membership.avoid import (
    Avoided,
    KeepOut,
    RepeatOffenders,
    agree_avoid,
    avoided,
    leave_round,
    publish_machine,
    write_avoid_file,
)
from tierckpt.launcher.membership.change import MEMBERSHIP_CHANGE, Change, shrink
from tierckpt.launcher.membership.seats import FirstSeats, SeatBeat
from tierckpt.launcher.membership.spares import JobEnded, SpareGate, arrivals, spares_waiting
from tierckpt.launcher.options import RunOptions

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
    workers: Any  # workers/runner.Workers
    _avoid: RepeatOffenders
    _seat_beat: SeatBeat | None
    _aside: bool  # this agent stands aside as a repeat offender: other waiting spares take seats first
    _avoid_next: list[dict[str, Any]]  # the avoid list of the last full job restart (the state file's "avoid")
    _avoid_checked: bool  # this process looked itself up in that list (at its first spare gate)

    if TYPE_CHECKING:  # the agent's (supervisor/torch_agent.py)
        @property
        def ctl(self) -> JobControl: ...

        @property
        def node(self) -> int: ...

        @property
        def nnodes(self) -> int: ...

        def _join(self) -> None: ...

        def _ended(self, exc: JobEnded) -> RunResult: ...

        def _settle(self, job_store: Any, *, spare_since: float | None, via: str) -> None: ...

        def _load_state(self) -> Any: ...  # supervisor/runstate.RunState

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

        round_store = dist.PrefixStore(keys.regroup_round(g), ctl.store)  # type: ignore[attr-defined]
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
        ready = self.workers.workers_ready
        me = self._avoided_here(job_store)
        gate = SpareGate(job_store, max_nodes, self._standing_by,
                         ready=ready,
                         on_warm=lambda: self._standing_by(None), seats=seats, offender=self._aside or me is not None,
                         hold_s=self.opts.avoid.wait_s if me is not None else 0.0, on_hold_over=self._avoid_ended)
        try:
            return gate.wait()
        finally:
            if gate.beat is not None:
                self._seat_beat = gate.beat

    def _avoided_here(self, job_store: Any) -> Avoided | None:
        """At this process's first spare gate: this node's entry in the avoid list of the last
        full job restart (its state file's, merged with the store's; avoid.py), reported as a
        ``spare`` event with ``state: "avoided"`` (written at once: the node holds no rank)."""
        if self._avoid_checked or not self._avoid.enabled:
            return None
        self._avoid_checked = True
        identity = ranks.identity(self.opts.memory_dir)
        me = avoided(agree_avoid(job_store, list(self._load_state().avoid)), identity, self.opts.avoid)
        if me is not None:
            self.events.emit("spare", generation=self.generation, state="avoided", identity=identity,
                             machine=me.machine, faults=me.faults, wait_s=self.opts.avoid.wait_s,
                             why=f"a repeat offender at the last full job restart ({me.faults} faults within "
                                 f"evalPeriodSeconds {self._avoid.policy.window_s}): other nodes take the seats "
                                 "first; it stands behind every other spare")
        return me

    def _avoid_ended(self) -> None:
        """An avoided node's hold at the first round's seats ended with a seat still free: it takes it."""
        self.events.emit("spare", generation=self.generation, state="avoid_ended",
                         identity=ranks.identity(self.opts.memory_dir),
                         why=f"no other node took the first round's free seat within --avoid-wait "
                             f"{self.opts.avoid.wait_s:g}s: this node takes it (the job does not start short)")

    def _avoid_after_round(self, job_store: Any, avoid: Sequence[Any]) -> None:
        """After a rendezvous round: carry the last full restart's avoid list (the state file's) to this
        incarnation's state saves, and publish this node's machine name (avoid.publish_machine)."""
        if not self._avoid.enabled:
            return
        self._avoid_next = [a.to_dict() for a in Avoided.parse(list(avoid))]
        publish_machine(job_store, ranks.identity(self.opts.memory_dir), self.opts.avoid.machine_name())

    def _avoid_at_full_restart(self, g: int) -> None:
        """A FULL_RESTART decision, before the exit barrier (the store is up): the repeat offenders
        the next start avoids (avoid.RepeatOffenders.at_full_restart, the same on every node), as
        ``offender`` events with ``at: "full_restart"``, the state file's ``avoid`` (``_save_state``)
        and the scheduler's hint file (``--avoid-file``)."""
        if not self._avoid.enabled:
            return
        out = self._avoid.at_full_restart(self.ctl.store, g)
        rank_of = {ident: rank for rank, ident in self._members.items()}
        for a in out:
            self.events.emit("offender", generation=g, at="full_restart", node=rank_of.get(a.identity),
                             identity=a.identity, machine=a.machine, faults=a.faults,
                             max_avoid=self._avoid.policy.max_avoid, window_s=self._avoid.policy.window_s,
                             why=f"{a.faults} faults within evalPeriodSeconds {self._avoid.policy.window_s}: "
                                 "the next start avoids this node")
        self._avoid_next = [a.to_dict() for a in out]
        path = self.opts.avoid.file
        if path is not None:
            try:
                write_avoid_file(path, out)
            except OSError as exc:  # the exit goes on; the scheduler gets no hint
                self.events.emit("warning", generation=g, what=f"--avoid-file {path}: {exc}")

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
