"""The control plane's schema: every key ``tierckpt run`` reads or writes on a store, named once.

The job store is the c10d rendezvous TCPStore that torch's agents already share (no second
server); each key below lives under ``tierckpt/run/``. ``<g>`` is a generation, ``<node>`` a
group rank; a counter is only ever ``add``ed, a claim is the first ``compare_set`` from empty.

    tierckpt/run/
        generation, full_restarts          counters raised to the highest offer (JobControl.join, claim)
        membership_changes, unhealthy_before   the same, for the restart-state file's streaks
        fault/<g>                          the first fault claim of g (JSON); fault/<g>/set wakes its waiters
        stopped/<g>                        the stop barrier's counter
        regroup/<g>                        the survivors' counter after a lost node; regroup/<g>/ prefixes
                                           their round store (torch's worker ranks)
        <counter>/done                     set by the agent that sees a counter reach its count (stopped,
                                           regroup, joined); the others wait on it
        exit/<g>, persisted/<g>            the exit and persist barriers' counters (polled)
        master/<g>                         host:port of the workers' store of g
        progress/<g>/<node>                the node's newest step
        agent-secret                       the node agents' job secret (the first compare_set wins)
        store-host                         the identity of the agent that serves this store (it sets
                                           it before each join barrier; the others read it after)
        agent/<membership>/<node>          host:port of the node's hosted node agent
        done/<node>                        the node's workers finished (done/0: the job did)
        live/<epoch>/beat/<node>           the node's liveness counter (liveness.py)
        live/<epoch>/verdict               the watcher's verdict (JSON)
        resume/bound/<g>                   the agreed TIERCKPT_RESUME_BEFORE of g (the first offer wins)
        resume/past/<g>                    nodes that moved past the bound (counter)
        resume/nonfinite/<g>               the lowest non-finite step offered (compare_set downwards)
        busy/<g>/<node>                    1 or 0: the node has a silent busy rank (busyboard.py)
        wait/<g>/<node>                    where the node's idle ranks wait: <rank>:<code>:<site>,...
        inproc-store/<g>                   host:port of the agent-hosted in-process store
        offenses                           the repeat offenders' faults (JSON), merged by compare_set
        unhealthy-nodes                    nodes whose health checks fail: {identity: {detail, time}} (JSON),
                                           merged by compare_set; kept out at restarts, avoided at full ones
        keep-out/<g>, keep-out/full/<g>    the agreed keep-out of g; the avoid list at a full restart
        machine/<identity>                 the scheduler's name of the node's machine
        avoid                              the avoid list of the last full job restart
        nodes                              nodes of the running round (group rank 0, after each round)
        seats                              seats opened for spares (counter); seats/<g>: who opened g's
        spare-tickets                      spares that came to the gate (counter, arrival order)
        spare-tickets/offender/<ticket>    the ticket was drawn by a repeat offender standing aside
        arrivals                           agents that passed the gate into a job below its maximum
        finished                           nodes of a finished job past their exit barrier
        first-seat/tickets                 agents that drew a first-round ticket (counter)
        first-seat/seat/<k>                the identity holding seat k
        first-seat/of/<identity>           the seat an identity holds
        first-seat/beat/<k>                its holder's counter

On the store of one rendezvous round (torch's, prefixed per round):

    tierckpt/joined                        the join barrier's counter (+ /done)
    tierckpt/rank-claim/<torch rank>       an agent's rank claim (ranks.Claim, JSON; a survivor's map by digest)
    tierckpt/rank-known/<digest>           a survivor's map of the last round, published once (zlib JSON)
    tierckpt/rank-known/<digest>/n         survivors that knew that map (the first publishes it)
    tierckpt/rank/<torch rank>             the group rank torch rank 0 decided for it (-1: the round broke)
    tierckpt/rank-members                  the last round's and this round's memberships (zlib JSON)
    tierckpt/rank-decided                  the decision (JSON; set last): the new membership's digest, and its
                                           difference from the survivors' map (none in a round without survivors)
"""

from __future__ import annotations

__all__ = [
    "AGENT_SECRET", "ARRIVALS", "AVOID", "FINISHED", "FIRST_SEAT_TICKETS", "FULL_RESTARTS", "GENERATION",
    "JOINED", "MEMBERSHIP_CHANGES", "NODES", "OFFENSES", "RANK_DECIDED", "RANK_MEMBERS", "SEATS", "SPARE_TICKETS", "STORE_HOST", "UNHEALTHY_BEFORE",
    "UNHEALTHY_NODES",
    "agent", "beat", "busy", "counter_done", "done", "exited", "fault", "fault_set", "first_seat",
    "first_seat_beat", "first_seat_of", "inproc_store", "keep_out", "keep_out_full", "machine", "master",
    "offender_ticket", "persisted", "progress", "rank_claim", "rank_decided", "rank_known", "rank_known_count", "regroup", "regroup_round", "resume_bound",
    "resume_nonfinite", "resume_past", "seats_opened", "stopped", "verdict", "wait",
]

_RUN = "tierckpt/run/"

GENERATION = _RUN + "generation"
FULL_RESTARTS = _RUN + "full_restarts"
MEMBERSHIP_CHANGES = _RUN + "membership_changes"
UNHEALTHY_BEFORE = _RUN + "unhealthy_before"
AGENT_SECRET = _RUN + "agent-secret"
OFFENSES = _RUN + "offenses"
UNHEALTHY_NODES = _RUN + "unhealthy-nodes"
AVOID = _RUN + "avoid"
STORE_HOST = _RUN + "store-host"
NODES = _RUN + "nodes"
SEATS = _RUN + "seats"
SPARE_TICKETS = _RUN + "spare-tickets"
ARRIVALS = _RUN + "arrivals"
FINISHED = _RUN + "finished"
FIRST_SEAT_TICKETS = _RUN + "first-seat/tickets"
JOINED = "tierckpt/joined"


def counter_done(counter: str) -> str:
    return f"{counter}/done"


def fault(generation: int) -> str:
    return f"{_RUN}fault/{generation}"


def fault_set(generation: int) -> str:
    return f"{fault(generation)}/set"


def stopped(generation: int) -> str:
    return f"{_RUN}stopped/{generation}"


def regroup(generation: int) -> str:
    return f"{_RUN}regroup/{generation}"


def regroup_round(generation: int) -> str:
    """The prefix of the survivors' round store after a regroup (torch assigns worker ranks there)."""
    return f"{regroup(generation)}/"


def exited(generation: int) -> str:
    return f"{_RUN}exit/{generation}"


def persisted(generation: int) -> str:
    return f"{_RUN}persisted/{generation}"


def master(generation: int) -> str:
    return f"{_RUN}master/{generation}"


def progress(generation: int, node: int) -> str:
    return f"{_RUN}progress/{generation}/{node}"


def agent(membership: int, node: int) -> str:
    return f"{_RUN}agent/{membership}/{node}"


def done(node: int) -> str:
    return f"{_RUN}done/{node}"


def beat(epoch: int, node: int) -> str:
    return f"{_RUN}live/{epoch}/beat/{node}"


def verdict(epoch: int) -> str:
    return f"{_RUN}live/{epoch}/verdict"


def resume_bound(generation: int) -> str:
    return f"{_RUN}resume/bound/{generation}"


def resume_past(generation: int) -> str:
    return f"{_RUN}resume/past/{generation}"


def resume_nonfinite(generation: int) -> str:
    return f"{_RUN}resume/nonfinite/{generation}"


def busy(generation: int, node: int) -> str:
    return f"{_RUN}busy/{generation}/{node}"


def wait(generation: int, node: int) -> str:
    return f"{_RUN}wait/{generation}/{node}"


def inproc_store(generation: int) -> str:
    return f"{_RUN}inproc-store/{generation}"


def keep_out(generation: int) -> str:
    return f"{_RUN}keep-out/{generation}"


def keep_out_full(generation: int) -> str:
    return f"{_RUN}keep-out/full/{generation}"


def machine(identity: str) -> str:
    return f"{_RUN}machine/{identity}"


def seats_opened(generation: int) -> str:
    return f"{SEATS}/{generation}"


def offender_ticket(ticket: int) -> str:
    return f"{SPARE_TICKETS}/offender/{ticket}"


def first_seat(seat: int) -> str:
    return f"{_RUN}first-seat/seat/{seat}"


def first_seat_of(identity: str) -> str:
    return f"{_RUN}first-seat/of/{identity}"


def first_seat_beat(seat: int) -> str:
    return f"{_RUN}first-seat/beat/{seat}"


def rank_claim(torch_rank: int) -> str:
    return f"tierckpt/rank-claim/{torch_rank}"


RANK_DECIDED = "tierckpt/rank-decided"
RANK_MEMBERS = "tierckpt/rank-members"


def rank_known(digest: str) -> str:
    return f"tierckpt/rank-known/{digest}"


def rank_known_count(digest: str) -> str:
    return f"tierckpt/rank-known/{digest}/n"


def rank_decided(torch_rank: int) -> str:
    return f"tierckpt/rank/{torch_rank}"
