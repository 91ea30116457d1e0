"""Who is in the job: one agent's side of every membership round, as a ``Round`` value.

A round is torch's rendezvous (c10d) or, for an elastic job that lost nodes and keeps at least
MIN, a regroup of the survivors through the store without a torch round (change.shrink). Around
it: the spare gate (a job on its maximum of nodes: stand by until a seat opens; seats.py before
the first round formed), the node's stable group rank (ranks.py), the repeat offenders kept out
and avoided (avoid.py), the arrivals of spares below MAX (spares.py) and the scale-up snooze.

Call order (the supervisor, supervisor/torch_agent.py):

    gate(handler, ready, generation)            # before torch's round (None: it did not wait)
    rendezvous(round_call, generation)          # torch's round, again while a member breaks it
    assign(store, group_rank, world, run_id, handler)   # inside torch's round: this node's stable rank
                                                # (O(1)): ours decided it in the round (gate gave it
                                                # the claim), else the claims are exchanged now
    after_round(job_store, offenses, avoid)     # once the round formed, with the state file's lists
    settled(job_store, node, nnodes, ...) -> Round   # after a round or a regroup: the value the parts follow;
                                                # reads the round's memberships (O(N) for a newcomer)
    grows(store, nnodes, waiting) / snoozed(now)   # every poll: a MembershipChange
    record(store, g, fault); keep_out(store, g, fault)   # a fault, after the stop barrier
    regroup(...) -> bool | stand_aside(handler) | forget()   # the recovery's membership step
    at_full_restart(store, g)                   # a FULL_RESTART decision, before the exit barrier
    close()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tierckpt.launcher.control import keys
from tierckpt.launcher.control.store import connect_client
from tierckpt.launcher.decide.offenders import OffenderPolicy
from tierckpt.launcher.events import Events
from tierckpt.launcher.membership import ranks, torch_rdzv
from tierckpt.launcher.membership.avoid import (
    Avoided,
    KeepOut,
    RepeatOffenders,
    agree_avoid,
    avoided,
    publish_machine,
    unhealthy_nodes,
    write_avoid_file,
)
from tierckpt.launcher.membership.change import MEMBERSHIP_CHANGE, Change, shrink
from tierckpt.launcher.membership.seats import FirstSeats, SeatBeat
from tierckpt.launcher.membership.snooze import ScaleUpSnooze, scaled_down
from tierckpt.launcher.membership.spares import SpareGate, arrivals, report_round, spares_waiting
from tierckpt.launcher.options import RunOptions

__all__ = ["Round", "Rounds"]


@dataclass(frozen=True, kw_only=True)
class Round:
    """What a rendezvous round or a regroup settled, as the supervisor hands it to its parts."""

    generation: int
    node: int  # this agent's group rank
    nnodes: int
    change: Change  # the membership before and after (reported as the ``membership`` event)
    via: str  # "rendezvous" or "regroup"


class Rounds:
    """One agent's membership state across rounds; see the module doc."""

    def __init__(self, opts: RunOptions, events: Events) -> None:
        self.opts = opts
        self.events = events
        self.held_rank: int | None = None  # the group rank this process held in its last round (ranks.py)
        self.stable_rank: int | None = None  # this round's group rank, set by ``assign``
        self._members: Mapping[int, str] = {}  # group rank -> identity of the last round (``members``)
        self._digest: str | None = None  # its name as the round's decision gave it (ranks.Decided.digest)
        self._decided: ranks.Decided | None = None  # this round's decision, its memberships not read yet
        self.claims_timeout_s = ranks.CLAIMS_TIMEOUT_S  # a member's claim after the close (ranks.RoundBroken)
        self._change = Change(before={}, after={})  # the last round's membership change, reported by ``settled``
        self._arrivals_seen = 0  # spares.arrivals when this round settled
        policy = opts.run_policy.restart_policy
        self.offenders = RepeatOffenders(OffenderPolicy.from_restart_policy(policy))  # avoid.py
        self._snooze = ScaleUpSnooze.from_restart_policy(policy)  # snooze.py
        self._scaled_down_at: float | None = None  # monotonic time of the last round with fewer nodes
        self._seat_beat: SeatBeat | None = None  # beats until the first round formed (seats.py)
        self._aside = False  # standing aside as a repeat offender (``stand_aside``)
        self.avoid_next: list[dict[str, Any]] = []  # avoid list of the last full job restart (state file)
        self._avoid_checked = False  # looked itself up in it at its first spare gate

    # ---- before and inside torch's round ----
    def gate(self, handler: Any, *, ready: Callable[[], bool], generation: int,
             load_avoid: Callable[[], Sequence[Any]]) -> float | None:
        """spares.SpareGate before torch's rendezvous; when this agent began standing by, or None.
        A survivor (it held a rank in this process) never waits there. Before the first round
        formed, the gate seats this agent in it or holds it as a spare (seats.py); the seat's
        beat runs until the round formed (group rank 0 published its node count). ``load_avoid``:
        the state file's avoid list, read at the first gate only."""
        if self.opts.elastic is not None and self.opts.elastic.allowed:  # rounds close on allowed counts only
            torch_rdzv.narrow(handler, self.opts.elastic.allowed)
        run_id = handler.get_run_id() if hasattr(handler, "get_run_id") else ""
        torch_rdzv.claim_with(handler, lambda: self.claim(run_id), self.claims_timeout_s)  # ours decides in the round
        if self.held_rank is not None:
            return None
        job_store, max_nodes = torch_rdzv.store_of(handler), torch_rdzv.max_nodes_of(handler)
        if job_store is None or max_nodes is None:
            return None
        host, port = getattr(job_store, "host", None), getattr(job_store, "port", None)
        seats = FirstSeats(ranks.identity(self.opts.memory_dir), stale_s=self.opts.node_timeout_s,
                           connect=lambda: connect_client(str(host), int(port))) \
            if isinstance(host, str) and isinstance(port, int) else None
        me = self._avoided_here(job_store, generation, load_avoid)
        gate = SpareGate(job_store, max_nodes, lambda n: self.standing_by(n, generation),
                         ready=ready, on_warm=lambda: self.standing_by(None, generation), seats=seats,
                         offender=self._aside or me is not None,
                         hold_s=self.opts.avoid.wait_s if me is not None else 0.0,
                         on_hold_over=lambda: self._avoid_ended(generation))
        try:
            return gate.wait()
        finally:
            if gate.beat is not None:
                self._seat_beat = gate.beat

    def standing_by(self, job_nodes: int | None, generation: int) -> None:
        """This agent stands by as a spare (``job_nodes``: the job's nodes), or its standbys just
        finished their imports (None): ``spare`` events ``standby`` and ``warm``."""
        fields: dict[str, Any] = {"state": "warm"} if job_nodes is None else {"state": "standby", "job_nodes": job_nodes}
        self.events.emit("spare", generation=generation, identity=ranks.identity(self.opts.memory_dir), **fields)

    def rendezvous(self, round_call: Callable[[], None], generation: int, *, attempts: int = 3) -> None:
        """torch's round (``round_call``), joined again while a member breaks it: one that arrived
        and died before it claimed its rank (``ranks.RoundBroken``, a ``warning`` event each time);
        the last attempt's error goes up."""
        for attempt in range(1, attempts + 1):
            try:
                round_call()
                return
            except ranks.RoundBroken as exc:
                if attempt == attempts:
                    raise
                self.events.emit("warning", generation=generation,
                                 what=f"{exc}; joining the next round (attempt {attempt + 1} of {attempts})")

    def claim(self, run_id: str) -> ranks.Claim:
        """This node's claim in the next round: the rank it held in this process (a survivor, with
        the membership it knew by its digest), else the one its memory root remembers."""
        memory_dir = self.opts.memory_dir
        survivor = self.held_rank is not None
        prior = self.held_rank if survivor else ranks.load_prior(memory_dir, run_id)
        return ranks.Claim(prior=prior, survivor=survivor, identity=ranks.identity(memory_dir),
                           members=self.members if survivor else None, digest=self._digest if survivor else None)

    def assign(self, store: Any, group_rank: int, group_world_size: int, run_id: str, handler: Any = None) -> int:
        """Inside torch's round: the group rank this node held before (ranks.py), instead of
        torch's arrival order; torch's rank assignment then runs from it. Our handler's round
        decided it already (``torch_rdzv.decided``: its leader applied the claims); after any
        other round the claims are exchanged in the round's store now (``ranks.exchange_round``).
        O(1) work: a survivor names the map it knew by the digest it was told, and the round's
        memberships are read when they are needed (``members``; ``settled`` at the latest), not
        before the rank is."""
        decided = torch_rdzv.decided(handler) if handler is not None else None
        if decided is None:
            decided = ranks.exchange_round(store, group_rank, group_world_size, self.claim(run_id),
                                           timeout=self.claims_timeout_s)
        self._decided = decided
        self.stable_rank = decided.rank
        return decided.rank

    @property
    def members(self) -> Mapping[int, str]:
        """Group rank -> identity of the last round; the round's memberships are read here first
        (one store ``get`` for a node that was no survivor, ranks.Decided.memberships)."""
        decided = self._decided
        if decided is not None:
            before, after = decided.memberships()
            self._change, self._members, self._digest, self._decided = \
                Change(before=before, after=after), after, decided.digest, None
        return self._members

    @members.setter
    def members(self, value: Mapping[int, str]) -> None:
        self._members, self._digest, self._decided = value, None, None

    @property
    def members_known(self) -> Mapping[int, str]:
        """``members`` without a store read: the last round whose memberships were read (the
        store-loss path, where the store is gone; normally this round's, read by ``settled``)."""
        return self._members

    def after_round(self, job_store: Any, offenses: Any, avoid: Sequence[Any]) -> None:
        """After a rendezvous round: the offenses the state file kept, the last full restart's
        avoid list carried to this incarnation's state saves, this node's machine name published."""
        self.offenders.remember(job_store, offenses)
        if not self._avoiding:
            return
        self.avoid_next = [a.to_dict() for a in Avoided.parse(list(avoid))]
        publish_machine(job_store, ranks.identity(self.opts.memory_dir), self.opts.avoid.machine_name())

    def settled(self, job_store: Any, *, generation: int, node: int, nnodes: int, run_id: str,
                spare_since: float | None, via: str) -> Round:
        """After a round or a regroup: keep the rank, report the membership (``spare``,
        ``membership`` events); the ``Round`` the detectors, liveness and node agent follow."""
        self.held_rank = node
        _ = self.members  # this round's memberships, read now (ranks.Decided.memberships)
        problem = ranks.save_prior(self.opts.memory_dir, run_id, node, nnodes)
        if problem is not None:
            self.events.emit("warning", generation=generation, what=problem)
        self._arrivals_seen = arrivals(job_store)
        change, self._change = self._change, Change(before={}, after={})
        if scaled_down(change):
            self._scaled_down_at = time.monotonic()
        report_round(self.events, generation, change, node=node, spare_since=spare_since, via=via)
        return Round(generation=generation, node=node, nnodes=nnodes, change=change, via=via)

    # ---- every poll ----
    def arrived(self, store: Any | None, nnodes: int) -> bool:
        """An agent passed the spare gate into a job below its maximum since this round settled
        (spares.arrivals: one store operation a poll, only while the job runs below MAX)."""
        el = self.opts.elastic
        if el is None or store is None or nnodes >= el.max_nodes:
            return False
        return arrivals(store) > self._arrivals_seen

    def grows(self, store: Any | None, nnodes: int, waiting: int) -> bool:
        """A node arrived (``waiting`` in torch's round, or ``arrived``) and the job may grow: with
        ``Elastic.allowed`` only when the nodes there make a count the job may run on (a surplus
        survivor waits there alone without restarting anyone); without it, any arrival."""
        el = self.opts.elastic
        if el is None or not el.allowed:
            return waiting > 0 or self.arrived(store, nnodes)
        seen = arrivals(store) - self._arrivals_seen if store is not None and nnodes < el.max_nodes else 0
        return el.grows(nnodes, max(waiting, seen))

    def snoozed(self, now: float) -> bool:
        """Whether a scale-up waits now (the snooze after a round with fewer nodes; snooze.py)."""
        return not self._snooze.allows(now, self._scaled_down_at)

    # ---- a fault ----
    def record(self, store: Any, g: int, fault: dict[str, Any]) -> None:
        """The fault against its node's identity (avoid.py), on every node after the stop."""
        self.offenders.record(store, g, fault, self.members)

    def keep_out(self, store: Any, g: int, fault: dict[str, Any]) -> KeepOut:
        """The repeat offenders the next round does without (the same on every node), reported
        as ``offender`` events; the waiting spares take their ranks."""
        pol = self.offenders.policy
        out = self.offenders.keep_out(store, g, fault, self.members, spares=spares_waiting(store),
                                      unhealthy=list(unhealthy_nodes(store)) if self.opts.health.enabled else ())
        for rank, ident in zip(out.ranks, out.identities, strict=True):
            if ident not in out.unhealthy:  # an unhealthy node's is a ``drain`` event (supervisor/draining.py)
                self.events.emit("offender", generation=g, node=rank, identity=ident,
                                 faults=self.offenders.count(ident), spares=out.spares, max_avoid=pol.max_avoid,
                                 window_s=pol.window_s)
        return out

    def lost_nodes(self, fault: dict[str, Any], lost: Callable[[], list[int]] | None) -> list[int]:
        """The group ranks a re-rendezvous lacks: a LostNode claim's, else (a machine gone with its
        reaper shows first as the survivors' Crash) the liveness verdict's, awaited up to
        ``--node-timeout`` (every survivor reads the same verdict key)."""
        if fault.get("reason") == "LostNode":
            return [int(n) for n in fault.get("lost") or [fault.get("node")] if n is not None]
        deadline = time.monotonic() + self.opts.node_timeout_s
        while lost is not None:
            now = lost()
            if now or time.monotonic() > deadline:
                return sorted(now)
            time.sleep(0.05)
        return []

    def regroup(self, fault: dict[str, Any], g: int, *, ctl: Any, node: int, nnodes: int,
                waiting: int | Callable[[], int], lost: Callable[[], list[int]] | None,
                assign: Callable[[Any, int, int], None], handler: Any = None) -> bool:
        """An elastic job that lost nodes and keeps at least MIN: the survivors agree on the next
        membership through the store (``JobControl.regroup``), without a torch rendezvous round;
        False (use the round) when ``change.shrink`` says so or a survivor does not arrive.
        ``waiting``: agents in torch's round now (or how to count them); with
        ``Elastic.scale_down_wait_s`` the survivors first wait that long for a node to take the lost
        one's place (a spare at the gate, a relaunched node in the round) and, when one comes, use
        the round; ``assign(round_store, rank, world)`` gives the workers their ranks (torch's own
        assignment) in the regrouped membership."""
        el = self.opts.elastic
        if el is None or not el.elastic or fault.get("reason") == MEMBERSHIP_CHANGE:
            return False
        count = waiting if callable(waiting) else (lambda: int(waiting))
        lost_now = self.lost_nodes(fault, lost)
        plan = shrink(nnodes=nnodes, lost=lost_now, elastic=el, spares_waiting=spares_waiting(ctl.store) + count())
        if plan.regroup and el.scale_down_wait_s > 0:  # faultyScaleDownTimeoutInSeconds: a replacement first
            deadline = time.monotonic() + el.scale_down_wait_s
            while plan.regroup and time.monotonic() < deadline:
                time.sleep(0.2)
                plan = shrink(nnodes=nnodes, lost=lost_now, elastic=el,
                              spares_waiting=spares_waiting(ctl.store) + count())
            waited = round(el.scale_down_wait_s - max(0.0, deadline - time.monotonic()), 3)
            self.events.emit("scale_down", generation=g, state="shrink" if plan.regroup else "replaced",
                             waited_s=waited, wait_s=el.scale_down_wait_s)
        if plan.regroup and node in plan.surplus:  # elasticPolicy forbids the survivors' count: this one waits
            if handler is not None:
                torch_rdzv.leave_round(handler)  # it waits in the next round as a newcomer, not the running job
            self.events.emit("spare", generation=g, state="surplus", identity=ranks.identity(self.opts.memory_dir),
                             keep=len(plan.survivors), why=plan.why)
        got = ctl.regroup(g, node, list(plan.survivors), timeout=self.opts.node_timeout_s) \
            if plan.regroup and node in plan.survivors else None
        if got is None:
            return False
        rank, world = got
        if handler is not None:
            torch_rdzv.regrouped(handler, world)  # below MAX again: the nodes waiting count (growth)
        import torch.distributed as dist

        assign(dist.PrefixStore(keys.regroup_round(g), ctl.store), rank, world)  # type: ignore[attr-defined]
        after = {new: self.members.get(old, "") for new, old in enumerate(plan.survivors)}
        self._change, self.members = Change(before=self.members, after=after), after
        self._digest = ranks.members_digest(after)  # here, not at the next round's claim
        return True

    def stand_aside(self, handler: Any) -> None:
        """This node is a repeat offender: out of torch's round; the next ``gate`` holds it as a
        node that holds no rank, behind every other spare waiting there (``SpareGate(offender=True)``).
        ``stood_aside()`` when that gate is over."""
        torch_rdzv.leave_round(handler)
        self.held_rank = None
        self._aside = True

    def stood_aside(self) -> None:
        self._aside = False

    def forget(self) -> None:
        """The others counted this node lost (a partition that healed): they went on without it,
        a spare may hold its rank; it comes back as a newcomer, through the spare gate, not straight
        into torch's round (whose redundancy list is unsafe, spares.py)."""
        self.held_rank = None

    def at_full_restart(self, store: Any, g: int) -> None:
        """A FULL_RESTART decision, before the exit barrier (the store is up): the repeat offenders
        the next start avoids (avoid.RepeatOffenders.at_full_restart, the same on every node), as
        ``offender`` events with ``at: "full_restart"``, the state file's ``avoid`` and the
        scheduler's hint file (``--avoid-file``)."""
        if not self._avoiding:
            return
        pol = self.offenders.policy
        sick = unhealthy_nodes(store) if self.opts.health.enabled else {}
        out = self.offenders.at_full_restart(store, g) if sick or self.offenders.enabled else []
        rank_of = {ident: rank for rank, ident in self.members.items()}
        for a in out:
            why = f"its health checks fail ({sick[a.identity].get('detail')}): the next start avoids this node" \
                if a.identity in sick else \
                f"{a.faults} faults within evalPeriodSeconds {pol.window_s}: the next start avoids this node"
            self.events.emit("offender", generation=g, at="full_restart", node=rank_of.get(a.identity),
                             identity=a.identity, machine=a.machine, faults=a.faults,
                             max_avoid=pol.max_avoid, window_s=pol.window_s, why=why)
        self.avoid_next = [a.to_dict() for a in out]
        path = self.opts.avoid.file
        if path is not None:
            try:
                write_avoid_file(path, out)
            except OSError as exc:  # the exit goes on; the scheduler gets no hint
                self.events.emit("warning", generation=g, what=f"--avoid-file {path}: {exc}")

    @property
    def _avoiding(self) -> bool:
        """Nodes may be avoided at a full job restart: repeat offenders, or unhealthy nodes."""
        return self.offenders.enabled or self.opts.health.enabled

    def close(self) -> None:
        if self._seat_beat is not None:
            self._seat_beat.stop()
            self._seat_beat = None

    # ---- the avoid list at the first gate ----
    def _avoided_here(self, job_store: Any, generation: int,
                      load_avoid: Callable[[], Sequence[Any]]) -> Avoided | None:
        """At this process's first spare gate: this node's entry in the avoid list of the last
        full job restart (its state file's, merged with the store's; avoid.py), reported as a
        ``spare`` event with ``state: "avoided"`` (written at once: the node holds no rank)."""
        if self._avoid_checked or not self._avoiding:
            return None
        self._avoid_checked = True
        identity = ranks.identity(self.opts.memory_dir)
        me = avoided(agree_avoid(job_store, list(load_avoid())), identity, self.opts.avoid)
        if me is not None:
            self.events.emit("spare", generation=generation, state="avoided", identity=identity,
                             machine=me.machine, faults=me.faults, wait_s=self.opts.avoid.wait_s,
                             why=(f"a repeat offender at the last full job restart ({me.faults} faults within "
                                  f"evalPeriodSeconds {self.offenders.policy.window_s})" if me.faults else
                                  "its health checks failed at the last full job restart")
                             + ": other nodes take the seats first; it stands behind every other spare")
        return me

    def _avoid_ended(self, generation: int) -> None:
        """An avoided node's hold at the first round's seats ended with a seat still free: it takes it."""
        self.events.emit("spare", generation=generation, state="avoid_ended",
                         identity=ranks.identity(self.opts.memory_dir),
                         why=f"no other node took the first round's free seat within --avoid-wait "
                             f"{self.opts.avoid.wait_s:g}s: this node takes it (the job does not start short)")
