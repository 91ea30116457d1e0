"""The supervisor of one node of ``tierckpt run``: the composition root that runs the monitor loop and
applies each recovery with the parts (rounds, workers, detectors, in-process restarts, node agent);
torch's LocalElasticAgent (torch_agent.py) only hands it its hooks.

Call order (one agent per node, all the same code):
  1. torch's ``run()`` → ``_invoke_run`` → ``Supervisor.run``: torch's rendezvous (c10d), then ``JobControl.join`` agrees
     on the generation; group rank 0 publishes a fresh master port for the generation and
     every agent starts its workers with TIERCKPT_GENERATION (= TORCHELASTIC_RESTART_COUNT).
     Before it, an agent takes a seat of the first round (seats.py) or waits at the spare gate.
  2. Every ``monitor_interval``: torch's process check (crash), heartbeats (hang, start-up
     deadline, non-finite loss), log rules, lost agents (liveness thread), and the store's
     fault claim for this generation (a fault on any node).
  3. A fault: claim it (the first claim of a generation wins), stop the local workers, ack on
     the stop barrier, decide (the same pure ``EscalationPolicy`` on the same history on every
     node), then restart in place (same membership, no rendezvous round), or re-rendezvous
     (a node was lost), or exit ``FULL_RESTART_EXIT`` / fail, persisting the newest memory step.
     Workers under ``tierckpt.resilient`` skip the stop: a live-process fault restarts them
     in-process (inprocess/restarts.py), a dead one is replaced alone while the others stay (replace.py).
     A re-rendezvous opens seats for spares waiting at the gate (spares.py); an elastic job
     whose survivors are at least MIN regroups without a round (membership/rounds.py, ``Rounds.regroup``).
     A ``MembershipChange`` (a node arrived) restarts without counting a restart. A repeat
     offender (avoid.py) leaves for the spare gate at a process restart; a waiting spare takes its rank.
  4. A node whose health checks fail (detect/healthwatch.py) with a spare waiting claims a ``Drain``
     at its next step boundary (supervisor/draining.py): no fault, no restart counted; it stands aside
     like a repeat offender and the spare takes its rank. With no spare it is reported and kept out
     at the next restart where a spare can take its rank (a full job restart avoids it).
"""

from __future__ import annotations

import logging
import shutil
import socket
import threading
import time
from typing import Any, Protocol

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous.api import RendezvousGracefulExitError

from tierckpt.launcher.control import keys, resume
from tierckpt.launcher.control.claimwatch import ClaimWatch
from tierckpt.launcher.control.jobcontrol import JobControl, Liveness
from tierckpt.launcher.control.store import connect_client, store_errors
from tierckpt.launcher.dataplane.host import NodeAgentHost, local_address
from tierckpt.launcher.decide.escalation import Action, Decision
from tierckpt.launcher.decide.recovery import Step, after_stop, barrier_all
from tierckpt.launcher.detect.busyboard import BusyBoard
from tierckpt.launcher.detect.detectors import Detectors
from tierckpt.launcher.detect.hang import Profile
from tierckpt.launcher.detect.wake import Waker
from tierckpt.launcher.events import Events, describe_error
from tierckpt.launcher.exiting import exit_now
from tierckpt.launcher.inprocess.replace import JOIN_ENV, REPLACE, StoreHost
from tierckpt.launcher.inprocess.restarts import InProcessRestarts
from tierckpt.launcher.membership import ranks
from tierckpt.launcher.membership.avoid import KeepOut
from tierckpt.launcher.membership.change import (
    DRAIN,
    MEMBERSHIP_CHANGE,
    missing_nodes,
)
from tierckpt.launcher.membership.rdzvwait import RendezvousProgress
from tierckpt.launcher.membership.rounds import Rounds
from tierckpt.launcher.membership.spares import (
    JobEnded,
    SpareWatch,
    finished,
    open_seats,
    publish_nodes,
)
from tierckpt.launcher.options import FULL_RESTART_EXIT, LAUNCHER_ERROR_EXIT, RunOptions
from tierckpt.launcher.supervisor.draining import Drainer
from tierckpt.launcher.supervisor.fidelity import Fidelity
from tierckpt.launcher.supervisor.findings import Findings, View
from tierckpt.launcher.supervisor.ledger import Ledger, fault_of
from tierckpt.launcher.supervisor.storeloss import StoreWatch
from tierckpt.launcher.workers.launch import static_env
from tierckpt.launcher.workers.reaper import Reaper
from tierckpt.launcher.workers.runner import Workers, free_master_port

__all__ = ["Supervisor", "TorchHooks"]

log = logging.getLogger("tierckpt.run")


class TorchHooks(Protocol):
    """What the supervisor uses of torch's LocalElasticAgent (supervisor/torch_agent.py)."""

    _worker_group: WorkerGroup
    _pcontext: Any
    _logs_specs: LogsSpecs
    _log_line_prefix_template: str | None
    _start_method: str

    @property
    def watchdog(self) -> Any: ...  # torch's file-timer watchdog of this generation (workers/watchdog.py)

    def torch_rendezvous(self, wg: WorkerGroup) -> None: ...

    def torch_assign(self, store: Any, rank: int, world: int, spec: WorkerSpec) -> list[Any]: ...

    def torch_watchdogs(self, envs: dict[int, dict[str, str]]) -> None: ...

    def _monitor_workers(self, wg: WorkerGroup) -> RunResult: ...

    def _exit_barrier(self) -> None: ...

    def _set_local_rank_env(self, env: dict[str, str | None], local_rank: int, spec: WorkerSpec) -> None: ...


class Supervisor:
    """The monitor loop and the recovery paths of one node; see the module doc."""

    def __init__(self, agent: TorchHooks, opts: RunOptions, *, reaper: Reaper | None = None) -> None:
        self.agent = agent  # torch's LocalElasticAgent (supervisor/torch_agent.py): the only way to torch's hooks
        self.opts = opts
        self.generation = 0
        self.exit_code = 0
        self.failure: str | None = None  # the one-line reason of a LAUNCHER_ERROR_EXIT (cli.py prints it)
        self._ctl: JobControl | None = None
        self._liveness: Liveness | None = None
        self._claims: ClaimWatch | None = None  # another node's claim, pushed by the store (claimwatch.py)
        self._waker = Waker()
        # ``node`` is the group rank, known from the first rendezvous on (None before it)
        self.events = Events(opts.events_path, node=None, host=socket.gethostname(), metrics_port=opts.metrics_port)
        # the processes, their standbys, the reaper that stops them if this process dies (workers/runner.py)
        self.workers = Workers(lambda beats: static_env(beats, namespace=opts.namespace, memory_dir=opts.memory_dir,
                                                        durable_url=opts.durable_url),
                               warm=opts.warm, stop_grace_s=opts.stop_grace_s, events=self.events, reaper=reaper)
        # heartbeats, /proc evidence, where idle ranks wait, log rules (detect/detectors.py)
        self._detectors = Detectors(opts.heartbeat, opts.run_policy.log_rules, self.workers.beat_dir)
        self.findings = Findings(self._detectors, self.events, node_timeout_s=opts.node_timeout_s)  # findings.py
        self._inproc = InProcessRestarts(self.events)  # workers under tierckpt.resilient (inprocess/restarts.py)
        self._inproc_store = StoreHost()  # group rank 0 hosts the workers' in-process store (replace.py)
        # the node agent: hosted, its peers discovered, prefetch and flush (dataplane/host.py)
        self._host = NodeAgentHost(opts.agent, self.events, across_hosts=opts.agent_across_hosts)
        # the node health monitor and this node's side of a drain to a waiting spare (draining.py)
        self.drainer = Drainer(opts, self.events, identity=ranks.identity(opts.memory_dir), replicated=self._replicated)
        # restart accounting and the state file (supervisor/ledger.py)
        self.ledger = Ledger(opts, lambda: self.wg.spec.rdzv_handler.get_run_id())
        self._store_addr: tuple[str, int] | None = None
        self._store = StoreWatch()  # the node that serves the job's store: a LostStore names it (storeloss.py)
        self._store_lost_once = threading.Lock()
        self.rounds = Rounds(opts, self.events)  # membership: gate, round, regroup, offenders (membership/rounds.py)
        self.resume_before: int | None = None  # TIERCKPT_RESUME_BEFORE of this generation (resume.py)
        self._past_marked = False  # this node told the store that this generation moved past it
        self._recovering: float | None = None  # detection time of the restart whose first steps are awaited
        self._recovering_kind = "process"  # the ``recovered`` event's kind: process, replace or job
        # hyperpodrun's parts: the HTTP API, the pre/post-train scripts, the namespace log (fidelity.py)
        self.fidelity = Fidelity(opts, self.events)

    @property
    def wg(self) -> WorkerGroup:
        """torch's worker group of this agent (its spec, workers, store, group rank)."""
        return self.agent._worker_group

    # ---- state kept beside the memory tier (survives a full job restart; ledger.py) ----
    def _save_state(self, next_generation: int, full_restarts: int) -> None:
        problem = self.ledger.save(next_generation, full_restarts, hang=self._learn().to_dict(),
                                   resume_before=self.resume_before, offenses=self.rounds.offenders.remembered,
                                   avoid=self.rounds.avoid_next)
        if problem is not None:
            self.events.emit("warning", generation=self.generation, what=problem)

    def _learn(self) -> Profile:
        """What this generation's heartbeats taught, added to what earlier ones did."""
        return self._detectors.learn()

    @property
    def node(self) -> int:
        """This agent's group rank (its node's place in the job), after a rendezvous."""
        return int(self.wg.group_rank or 0)

    def _node_of(self, rank: int) -> int | None:
        """The node (group rank) that runs global ``rank``: torch gives each node a block of
        ``nproc-per-node`` consecutive global ranks, in group-rank order."""
        per = len(self.wg.workers)
        return rank // per if per and rank >= 0 else None

    @property
    def nnodes(self) -> int:
        return int(self.wg.group_world_size or 1)

    # ---- rendezvous + generation ----
    def _join(self) -> None:
        wg = self.wg
        handler = wg.spec.rdzv_handler
        # a job running on its maximum of nodes: stand by until a seat opens
        gated = self.rounds.gate(handler, ready=self.workers.workers_ready, generation=self.generation,
                                 load_avoid=lambda: self.ledger.load().avoid)
        with RendezvousProgress(handler, self.opts.rdzv_endpoint or "the rendezvous"), \
                SpareWatch(handler, lambda n: self.rounds.standing_by(n, self.generation)) as spare:
            self.rounds.rendezvous(lambda: self.agent.torch_rendezvous(wg), self.generation)
        if self.rounds.stable_rank is not None:  # torch set its own order's rank; ours is the node's old one
            wg.group_rank = self.rounds.stable_rank  # type: ignore[assignment]  # torch annotates it None
        store = wg.store
        job_store: Any = getattr(store, "underlying_store", store)
        self._ctl = JobControl(job_store)
        st = self.ledger.load()
        self._detectors.learned.merge(Profile.from_dict(st.hang))
        resume.offer(job_store, st.next_generation, st.resume_before)
        self.ledger.offer(st, self.ctl)  # before the barrier: every node reads every offer after it
        self._store.offer(job_store, ranks.identity(self.opts.memory_dir))
        self.generation, full_restarts = self.ctl.join(
            store, self.nnodes, local_next=st.next_generation, local_full=st.full_restarts)
        self.ledger.joined(st, self.ctl, full_restarts)
        self._store.learn(job_store)
        self.rounds.after_round(job_store, st.offenses, st.avoid)  # the last full restart's avoid list
        self.resume_before = resume.agreed(job_store, self.generation)
        self._settle(job_store, spare_since=gated if gated is not None else spare.since, via="rendezvous")

    def _settle(self, job_store: Any, *, spare_since: float | None, via: str) -> None:
        """After a rendezvous round or a regroup: point the detectors, the liveness verdict and the
        node agent at the new membership, then let ``Rounds`` report it (``spare``, ``membership``)."""
        self.events.node = self.node
        self._detectors.follow(BusyBoard(job_store, self.node))
        self._store_addr = (str(job_store.host), int(job_store.port))
        if self._liveness is None:
            host, port = job_store.host, job_store.port
            # its calls time out within the node timeout: a store whose host drops packets blocks each
            # call for the client's timeout, and the loss is judged by the time since one succeeded
            op_timeout = max(1.0, self.opts.node_timeout_s / 2)
            self._liveness = Liveness(lambda: connect_client(host, port, op_timeout), self.node,
                                      interval_s=self.opts.liveness_interval_s, timeout_s=self.opts.node_timeout_s,
                                      on_store_lost=self._store_lost)
            self._liveness.start()
            self._claims = ClaimWatch(lambda: connect_client(host, port), self._waker.notify,
                                      lambda g: JobControl(connect_client(host, port, 5.0)).release_claim_waiters(g))
        self._liveness.reset(self.node, list(range(self.nnodes)), epoch=self.generation)
        # a new round: publish the node agent's address again (in-place restarts keep the membership)
        self._host.follow(self.generation, self.node, self.nnodes)
        if self.node == 0:
            publish_nodes(job_store, self.nnodes)
        self.rounds.settled(job_store, generation=self.generation, node=self.node, nnodes=self.nnodes,
                            run_id=self.wg.spec.rdzv_handler.get_run_id(), spare_since=spare_since, via=via)

    def _regroup(self, fault: dict[str, Any], g: int) -> bool:
        """An elastic job that lost nodes keeps going on the survivors without a torch round (rounds.py)."""
        wg = self.wg

        def assign(round_store: Any, rank: int, world: int) -> None:
            wg.workers = self.agent.torch_assign(round_store, rank, world, wg.spec)
            wg.store, wg.group_rank, wg.group_world_size = round_store, rank, world  # type: ignore[assignment]

        if not self.rounds.regroup(fault, g, ctl=self.ctl, node=self.node, nnodes=self.nnodes,
                                   waiting=wg.spec.rdzv_handler.num_nodes_waiting, handler=wg.spec.rdzv_handler,
                                   lost=self._liveness.lost if self._liveness is not None else None, assign=assign):
            return False
        self.generation = g + 1
        self._settle(self.ctl.store, spare_since=None, via="regroup")
        return True

    def _stand_aside(self, g: int) -> RunResult | None:
        """A repeat offender: out of torch's round, to the spare gate behind every other spare;
        None when a seat opens for it again, a RunResult when the job ended."""
        self.rounds.stand_aside(self.wg.spec.rdzv_handler)
        try:
            self._join()
        except JobEnded as exc:
            return self._ended(exc)
        finally:
            self.rounds.stood_aside()
        return None

    @property
    def ctl(self) -> JobControl:
        """The job's control plane; exists from the first rendezvous round (``_join``) on."""
        if self._ctl is None:
            from tierckpt.errors import ProtocolError

            raise ProtocolError("the launcher used its control plane before the first rendezvous round")
        return self._ctl

    def _master_for(self, generation: int) -> tuple[str, int]:
        if self.node == 0:
            addr = self._local_host()
            port = free_master_port()
            self.ctl.publish_master(generation, addr, port)
            return addr, port
        return self.ctl.master(generation, timeout=max(60.0, self.opts.node_timeout_s))

    # ---- workers ----
    def _arm_detectors(self, wg: WorkerGroup) -> None:
        ctx = self.workers.ctx
        self.findings.arm([w.local_rank for w in wg.workers], (ctx.stdouts, ctx.stderrs) if ctx is not None else ())
        self._past_marked = False

    def _watch_resume(self) -> None:
        """Tell the store once per generation that this node's ranks moved past the resume bound."""
        bound = self.resume_before
        if bound is None or self._past_marked or self._ctl is None:
            return
        if resume.moved_past(self._detectors.steps(), bound):
            resume.mark_past(self.ctl.store, self.generation)
            self._past_marked = True

    def _report_recovery(self) -> None:
        """``recovered``: every local rank of the restarted generation took its first step (beat)."""
        if self._recovering is None or not self.findings.all_beat():
            return
        recovery = time.monotonic() - self._recovering
        self._recovering = None
        self.events.emit("recovered", generation=self.generation, recovery_s=round(recovery, 3),
                         step=self.findings.progress(), kind=self._recovering_kind)  # events.py: the metrics

    def _rearm_trackers(self) -> None:
        self.findings.rearm()

    def _stop_now(self) -> None:
        self.workers.stop()

    # ---- detection: every detector's evidence, then one diagnosis (findings.py) ----
    def _detect(self, result: RunResult) -> dict[str, Any] | None:
        """The claim to make at this poll (None: nothing, or a symptom waiting for its cause)."""
        wg, ctx, dog = self.wg, self.workers.ctx, self.agent.watchdog
        arrival = not self.rounds.snoozed(time.monotonic()) and self.rounds.grows(  # elasticPolicy's counts
            self._ctl.store if self._ctl else None, self.nnodes, wg.spec.rdzv_handler.num_nodes_waiting())
        view = View(generation=self.generation, node=self.node, nnodes=self.nnodes,
                    ranks={w.local_rank: w.global_rank for w in wg.workers}, pids=self.workers.pids(),
                    outputs=(ctx.stderrs, ctx.stdouts) if ctx is not None else (),
                    expired=dog.expired if dog is not None else None, arrival=arrival,
                    deadline=self.ledger.deadline(time.time(), generation_started=self.findings.generation_started,
                                                  all_beat=self.findings.all_beat))
        return self.findings.detect(result, view, self._liveness)

    def _replicated(self) -> dict[str, int] | None:
        """The hosted node agent's newest step replicated per own namespace (None: it does not replicate)."""
        agent = self._host.agent
        return agent.replicated_steps() if agent is not None and agent.config.replicas > 0 else None

    def _drain_claim(self) -> dict[str, Any] | None:
        """This node's ``Drain`` claim when it is unhealthy, a spare waits and a step boundary passed."""
        return self.drainer.poll(self.ctl.store, generation=self.generation, node=self.node,
                                 record=lambda reason, detail: self.findings.record(
                                     reason, None, detail, since=None, generation=self.generation, node=self.node))

    # ---- the loop ----
    def _failed(self, exc: Exception) -> None:
        """The loop raised what nothing handles: stop the workers, persist, exit LAUNCHER_ERROR_EXIT."""
        self.failure = describe_error(exc)
        log.debug("tierckpt run: the launcher loop failed", exc_info=exc)
        try:
            self._stop_now()
        except Exception as stop_exc:  # the exit goes on; the failure is reported
            self.events.emit("warning", generation=self.generation, what=f"stopping the workers failed: {stop_exc}")
        self._persist(barrier=False)
        self.exit_code = LAUNCHER_ERROR_EXIT
        self.events.emit("exit", generation=self.generation, code=self.exit_code, why=f"launcher error: {self.failure}")
        self.wg.state = WorkerState.FAILED

    def _local_host(self) -> str:
        """This node's address for the other nodes (the master's, the node agent's)."""
        wg = self.wg
        return wg.spec.local_addr or local_address(str(wg.master_addr))

    def _prefetch(self) -> None:
        """Right after a rendezvous, before the workers start: the hosted agent pulls this node's
        ranks' newest state from peers if its memory lacks it (launcher/dataplane/prefetch.py)."""
        self._host.prefetch(self._ctl, self._local_host, self.opts.namespace,
                            [w.global_rank for w in self.wg.workers], self.generation,
                            wait_s=min(5.0, self.opts.node_timeout_s))

    def _loop(self) -> RunResult:
        wg = self.wg
        spec = wg.spec
        if not self.opts.agent_across_hosts:
            self._host.start(self.generation, lambda: self.ctl.job_secret())
        self.drainer.start(self.generation)  # health checks run from the start, at the spare gate too
        self.workers.start_pool(spec)
        try:
            self._join()
        except JobEnded as exc:  # a spare that was never needed
            return self._ended(exc)
        if self.opts.agent_across_hosts:
            self._host.start(self.generation, lambda: self.ctl.job_secret())  # its secret comes from the store
        self._prefetch()
        self._start_workers_logged(wg)
        since = self.ledger.full_restart_at_start  # this incarnation follows a full job restart: its downtime
        if since is not None:
            self._recovering, self._recovering_kind = time.monotonic() - max(0.0, time.time() - since), "job"
        self.events.emit("started", generation=self.generation, nnodes=self.nnodes,
                         world_size=len(wg.workers) * self.nnodes, pids=list(self.workers.ctx.pids().values())
                         if self.workers.ctx else [], warm=self.workers.warm_ranks)
        while True:
            # a worker's exit (SIGCHLD) ends the wait at once (wake.py); so does another node's
            # claim (claimwatch.py: the store wakes a thread that wakes this loop)
            woke = self._waker.wait(spec.monitor_interval)
            self.findings.woke(woke)
            result = self.agent._monitor_workers(wg)
            wg.state = result.state
            self.workers.refill(self.generation)
            if self._inproc.poll(self.generation, node_of=self._node_of):
                self._rearm_trackers()
            self._host.discover(self._ctl, self._local_host)
            if result.state == WorkerState.SUCCEEDED:
                self.fidelity.post_train(self.generation, self.node)
                self.ctl.mark_done(self.node)
                self.agent._exit_barrier()
                try:  # a spare at the gate may host the store: it leaves once every node got here
                    finished(self.ctl.store)
                except store_errors():
                    pass
                self.events.emit("exit", generation=self.generation, code=0)
                return result
            progress = self.findings.progress()
            if progress is not None:
                self.events.step.set(progress)
            self._watch_resume()
            self._report_recovery()
            claims = self._claims
            if claims is not None:
                claims.follow(self.generation)
            claimed = self.ctl.claimed(self.generation) if claims is None or claims.due(self.generation) else None
            if claimed is None:
                local = self._detect(result)
                if local is None:  # a fault first; else an unhealthy node's drain at a step boundary
                    local = self._drain_claim()
                if local is None:  # nothing, or a symptom held for its cause (a peer's own claim is due first)
                    continue
                claimed = self.ctl.claim(self.generation, self._tagged(local))
            outcome = self._recover(claimed)
            if outcome is not None:
                return outcome

    def _ended(self, exc: JobEnded) -> RunResult:
        """A spare (or an evicted node standing by again) that the job finished without: exit 0."""
        self.events.emit("exit", generation=self.generation, code=0, why=str(exc))
        self.wg.workers = []  # none holds a rank now (torch's run() reports each worker)
        return RunResult(state=WorkerState.SUCCEEDED)

    def _start_workers_logged(self, wg: WorkerGroup) -> None:
        self.start_workers(wg)
        self.workers.launched(wg, store=self._store_addr, generation=self.generation, node=self.node,
                              generation_started=self.findings.generation_started, resumed_step=self.findings.resumed_step,
                              events=self.opts.events_path)

    def _recover(self, fault: dict[str, Any]) -> RunResult | None:
        """Stop, agree, decide; restart in place (None) or end the run (a RunResult)."""
        wg = self.wg
        t_detect = time.monotonic()
        g = self.generation
        self._watch_resume()  # the beats observed by the poll that found the fault count too
        self._recovering = None
        if fault.get("reason") != DRAIN:  # a drain is no fault: its ``drain`` event follows the keep-out
            self.events.emit("fault", generation=g, **{k: fault.get(k) for k in ("reason", "node", "rank", "detail", "step")},
                             detection_latency_s=fault.get("detection_latency_s"), **_kind(fault),
                             **{k: fault[k] for k in ("symptom", "settle_s", "lost", "diagnosis") if k in fault},
                             heartbeat_timeout_s=self._detectors.timeout())
        if self._replace_alone(fault, g, t_detect):
            return None
        if self._inproc.handles(fault, self.node) and self._inproc.restart(  # a replace: from the claim's detection
                g, fault.get("reason"), kind=str(fault.get("kind") or "inprocess"),
                since=fault.get("time") if _kind(fault) else None, abandon=self._lost_now) is not None:
            self.generation = g + 1  # the processes stay; a fresh claim key for the next fault
            self._rearm_trackers()
            return None
        self._stop_now()
        self.events.emit("stopped", generation=g, ranks=[w.global_rank for w in wg.workers])
        resume.offer_non_finite(self.ctl.store, g, self.findings.nan_step())
        self.ctl.stopped(g)
        claims = [fault_of(r) for r in self.ctl.history(g)]
        self.ledger.count(claims)
        self.rounds.record(self.ctl.store, g, fault)  # by node identity (avoid.py)
        decision = _not_a_fault(fault) or self.ledger.decide(claims, g)
        lost_now = self._lost_now()  # counted lost meanwhile (the fault itself may be a survivor's symptom)
        all_here = barrier_all(str(fault.get("reason")), lost_now) and \
            self.ctl.wait_stopped(g, self.nnodes, timeout=self.opts.node_timeout_s)
        if lost_now and fault.get("reason") != "LostNode":  # the live nodes' marks, not the lost ones'
            self.ctl.wait_stopped(g, self.nnodes - len(lost_now), timeout=self.opts.node_timeout_s)
        # after the stop barrier every node's mark for g is in: all compute the same bound
        self.resume_before = resume.advance(self.resume_before, fault,
                                            resume.passed(self.ctl.store, g, self.nnodes),
                                            resume.lowest_non_finite(self.ctl.store, g))
        out = self.rounds.keep_out(self.ctl.store, g, fault) if all_here and decision.action == Action.RESTART else KeepOut()
        if out.unhealthy or fault.get("reason") == DRAIN:
            self.drainer.drained(fault, out, generation=g, store=self.ctl.store)  # ``drain`` events
        plan = after_stop(fault, decision, me=self.node, all_here=all_here, keep_out=out.ranks)  # decide/recovery.py
        if plan.step is Step.FINISH:
            return self._finish(decision, all_here)
        self._save_state(g + 1, self.ledger.full_restarts)
        if decision.delay_s > 0:
            self.events.emit("backoff", generation=g, delay_s=round(decision.delay_s, 3), why=decision.reason)
            time.sleep(decision.delay_s)
        if plan.step is Step.RESTART_IN_PLACE:
            self.generation = g + 1
            self._start_workers_logged(wg)
        else:  # a node is gone, new or kept out: torch's rendezvous waits for the membership to settle
            self.events.emit("warning", generation=g, what="re-rendezvous: waiting for the nodes to rejoin")
            open_seats(self.ctl.store, g, self.node,
                       missing_nodes(fault, self.nnodes, self.ctl.stopped_count(g)) + plan.kept_out)
            self._save_state(g + 1, self.ledger.full_restarts)
            if plan.step is Step.STAND_ASIDE:
                ended = self._stand_aside(g)
                if ended is not None:
                    return ended
            else:
                if plan.forget_rank:  # the others counted it lost (a partition that healed): a newcomer
                    self.rounds.forget()
                try:
                    if plan.step is Step.RERENDEZVOUS or not self._regroup(fault, g):
                        self._join()
                except JobEnded as exc:  # it stood by as a spare until the job finished without it
                    return self._ended(exc)
            self.generation = max(self.generation, g + 1)
            self._prefetch()
            self._start_workers_logged(wg)
        handover = time.monotonic() - t_detect
        self._recovering, self._recovering_kind = t_detect, "process"  # recovery_s: at the first beat of every local rank
        if fault.get("detection_latency_s") is not None:
            self.events.detection.set(float(fault["detection_latency_s"]))
        self.events.emit("restart", generation=self.generation, kind="process", reason=fault.get("reason"),
                         why=decision.reason, handover_s=round(handover, 3), resume_before=self.resume_before,
                         pids=list(self.workers.ctx.pids().values()) if self.workers.ctx else [], warm=self.workers.warm_ranks)
        return None

    def _lost_now(self) -> list[int]:
        """The other nodes the liveness verdict counts lost now ([] without liveness)."""
        return self._liveness.lost() if self._liveness is not None else []

    def _tagged(self, record: dict[str, Any]) -> dict[str, Any]:
        """A local crash, marked for a replacement alone when the workers allow it (ledger.tagged)."""
        if record.get("reason") != "Crash" or not self._inproc.replaceable:
            return record
        return self.ledger.tagged(record, self.generation, self.ctl)

    def _replace_alone(self, fault: dict[str, Any], g: int, t_detect: float) -> bool:
        """This node's worker died under the wrapper: one replacement process joins the survivors'
        next in-process generation (replace.py). False: nothing replaced, or it did not join."""
        wg = self.wg
        lr = next((w.local_rank for w in wg.workers if w.global_rank == fault.get("rank")), None)
        if fault.get("kind") != REPLACE or fault.get("node") != self.node or lr is None or \
                not self.workers.replaceable():
            return False
        self.ledger.count([fault_of(r) for r in self.ctl.history(g)])
        if float(fault.get("delay_s") or 0.0) > 0:
            self.events.emit("backoff", generation=g, delay_s=round(float(fault["delay_s"]), 3), why=fault.get("why"))
            time.sleep(float(fault["delay_s"]))
        pid, warm = self.workers.replace(lr, {JOIN_ENV: str(fault.get("reason"))})
        wg.workers[lr].id = pid
        if self._inproc.restart(g, fault.get("reason"), kind=REPLACE, since=time.time() - (time.monotonic() - t_detect),
                                rank=fault.get("rank"), pid=pid, warm=warm, why=fault.get("why")) is None:
            self.events.emit("warning", generation=g, what=f"the replacement of rank {fault.get('rank')} (pid {pid}) "
                             "did not join the survivors in time: restarting every process")
            return False
        self._save_state(g + 1, self.ledger.full_restarts)
        self.generation = g + 1
        self._rearm_trackers()
        self._recovering, self._recovering_kind = t_detect, "replace"  # ``recovered``: at the first beat of every local rank
        return True

    def _finish(self, decision: Decision, all_here: bool) -> RunResult:
        g = self.generation
        if decision.action == Action.FULL_RESTART:  # before the exit barrier: the store is still up
            self.rounds.at_full_restart(self.ctl.store, g)
        self._persist(barrier=all_here)
        if all_here:  # the store's host must not leave while the others still read it
            self._barrier(keys.exited(g), timeout=30.0)
        if decision.action == Action.FULL_RESTART:
            self.ledger.full_restart_at = time.time()  # its downtime runs until the next incarnation's first steps
            self._save_state(g + 1, self.ledger.full_restarts + 1)
            self.events.emit("restart", generation=g, kind="job", why=decision.reason)
            self.exit_code = FULL_RESTART_EXIT
        else:
            self._save_state(g + 1, self.ledger.full_restarts)
            self.exit_code = 1
        self.events.emit("exit", generation=g, code=self.exit_code, why=decision.reason)
        self.wg.state = WorkerState.FAILED
        return RunResult(state=WorkerState.FAILED)

    def _barrier(self, key: str, timeout: float) -> bool:
        ctl = self._ctl
        if ctl is None:
            return False
        try:
            ctl.store.add(key, 1)
            deadline = time.monotonic() + timeout
            while int(ctl.store.add(key, 0)) < self.nnodes:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.02)
            return True
        except store_errors():
            return False

    def _persist(self, *, barrier: bool) -> None:
        o = self.opts
        if not (o.namespace and o.durable_url):
            return
        if self._host.agent is not None:  # the node's agent drains: ask it to flush and wait
            try:
                self.events.emit("persisted", generation=self.generation, flush=self._host.flush())
            except Exception as exc:  # the exit goes on; the failure is reported
                self.events.emit("warning", generation=self.generation, what=f"agent flush failed: {exc}")
            return
        from tierckpt.config import DEFAULT_MEMORY_DIR, CheckpointConfig
        from tierckpt.launcher.dataplane.persist import persist_all

        def wait_all() -> bool:
            return self._barrier(keys.persisted(self.generation), timeout=60.0)

        try:
            cfg = CheckpointConfig(namespace=o.namespace, memory_dir=o.memory_dir or DEFAULT_MEMORY_DIR,
                                   durable_url=o.durable_url)
            steps = persist_all(cfg, leader=self.node == 0, barrier=wait_all if barrier and self.nnodes > 1 else None)
            self.events.emit("persisted", generation=self.generation, steps=steps)
        except Exception as exc:  # the exit goes on; the failure is reported
            self.events.emit("warning", generation=self.generation, what=f"persist failed: {exc}")


    def start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """torch's ``_start_workers`` hook: this generation's master, then ``Workers.start``."""
        g = self.generation
        addr, port = self._master_for(g)
        self.fidelity.pre_train(g, self.node)  # --pre-train-script, at every (re)start of the processes
        extra = {resume.ENV: str(self.resume_before)} if self.resume_before is not None else {}
        extra.update(self._inproc_store.env(self.ctl, self.node, g, addr, timeout_s=max(60.0, self.opts.node_timeout_s)))
        self.agent._pcontext = ctx = self.workers.start(
            worker_group, generation=g, addr=addr, port=port, extra=extra,
            set_local_rank_env=lambda env, lr: self.agent._set_local_rank_env(env, lr, worker_group.spec),  # type: ignore[arg-type]
            logs_specs=self.agent._logs_specs, prefix_template=self.agent._log_line_prefix_template,
            start_method=self.agent._start_method, before=self.agent.torch_watchdogs)
        self._arm_detectors(worker_group)
        self._inproc.arm(self.workers.beat_dir, [w.local_rank for w in worker_group.workers])
        return ctx.pids()


    def run(self) -> RunResult:
        """torch's ``_invoke_run``: the whole run of this agent (the module doc's call order)."""
        try:
            return self._loop()
        except store_errors() as exc:  # the rendezvous store (its host agent) is gone
            if not self._store_lost_once.acquire(blocking=False):  # the liveness thread decided it: it exits
                time.sleep(3600)
            self._lost_store(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            self.wg.state = WorkerState.FAILED
            return RunResult(state=WorkerState.FAILED)
        except SignalException as exc:
            self._stop_now()
            self.events.emit("stopped", generation=self.generation, cause=f"signal {exc.sigval.name}")
            self._persist(barrier=False)
            self.exit_code = 128 + int(exc.sigval)
            self.events.emit("exit", generation=self.generation, code=self.exit_code)
            raise
        except RendezvousGracefulExitError:
            raise  # torch's run() ends quietly on it
        except Exception as exc:  # no traceback: the workers stop, an exit event says why (docs/launcher.md)
            self._failed(exc)
            return RunResult(state=WorkerState.FAILED)
        finally:
            if self._liveness is not None:
                self._liveness.close()
            if self._claims is not None:
                self._claims.close()
            self._waker.close()
            shutil.rmtree(self.workers.beat_dir, ignore_errors=True)


    def _store_lost(self, why: str) -> None:
        """Liveness's ``on_store_lost``, on its watchdog thread: no call to the store succeeded for
        the node timeout. The main thread may be blocked in a call to the store (each blocks for its
        client's timeout when the store's host drops packets), so this thread ends the run: the
        workers stopped, ``LostStore`` naming the store's node, exit 75 (a full restart, which the
        scheduler requeues; the next start resumes from the memory tiers and their replicas)."""
        if not self._store_lost_once.acquire(blocking=False):  # the main thread got there first
            return
        # whatever else blocks on the store (a persist, a part's close), the process exits 75 in time
        failsafe = threading.Timer(self.opts.stop_grace_s + 30.0, exit_now, args=(FULL_RESTART_EXIT,))
        failsafe.daemon = True
        failsafe.start()
        try:
            self._lost_store(why)
            self.workers.close()
        finally:
            exit_now(self.exit_code or FULL_RESTART_EXIT)

    def _lost_store(self, why: str) -> None:
        """The job's store is gone: stop, report, persist what this node can alone, exit code 75."""
        self._stop_now()
        store_node = self._store.node(self.rounds.members_known)  # no store read: it is gone
        self.events.emit("fault", generation=self.generation, reason="LostStore", rank=None, node=store_node,
                         store=self._store.identity, detail=why)
        self._persist(barrier=False)
        self.exit_code = FULL_RESTART_EXIT
        self.events.emit("restart", generation=self.generation, kind="job", why="the rendezvous store is gone")
        self.events.emit("exit", generation=self.generation, code=self.exit_code)

    def close(self) -> None:
        self.drainer.close()
        self.rounds.close()
        self.workers.close()  # the reaper first: the workers were stopped already
        self._detectors.close()
        self._host.close()
        self.fidelity.close()
        self.events.close()

def _not_a_fault(fault: dict[str, Any]) -> Decision | None:
    """The restart of a claim that is no fault (a node joined, an unhealthy node left for a spare):
    at once, counted nowhere; None for a fault (the escalation decides)."""
    if fault.get("reason") == MEMBERSHIP_CHANGE:
        return Decision(Action.RESTART, 0.0, "membership change: a node joined; no restart counted")
    if fault.get("reason") == DRAIN:
        return Decision(Action.RESTART, 0.0, f"drain: node {fault.get('node')} is unhealthy "
                        f"({fault.get('detail')}); no restart counted")
    return None


def _kind(fault: dict[str, Any]) -> dict[str, Any]:
    """``{"kind": "replace"}`` for a crash tagged for a replacement alone, else nothing."""
    return {"kind": fault["kind"]} if fault.get("kind") == REPLACE else {}
