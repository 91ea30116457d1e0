"""What the launcher reads of a rendezvous handler, in one place: the public face of ours
(``--rdzv-backend tierckpt``, rdzv.py) and the private fields of torch's c10d
``DynamicRendezvousHandler`` (read in torch 2.6 to 2.13, each with ``getattr`` and a fallback, so a
torch that renamed one loses a report or a shortcut, never the job).

    store_of(handler)         the job store (a TCPStore), or None (the static backend)
    max_nodes_of(handler)     --nnodes MAX, or None
    joined(handler)           (nodes in the round this agent waits in, nodes needed), for the progress line
    standing_by(handler)      the running round's nodes if this agent waits in torch's redundancy list
    leave_round(handler)      take this agent out of torch's completed round (a repeat offender
                              standing aside): True when the others need not wait for its keep-alive
    narrow(handler, allowed)  the node counts a round may close with (ours; c10d cannot: False)
    regrouped(handler, world) the running job regrouped without a round: ours counts the nodes
                              waiting against the new size (below MAX again after a shrink)
    claim_with(handler, claim, timeout_s)  ours: each arrival carries this node's rank claim, and
                              the round's leader decides the stable ranks (c10d cannot: False)
    decided(handler)          ours: the last round's decision (ranks.Decided), or None (c10d, or a
                              round ranked by host order: the launcher exchanges the claims then)

Pinned by ``tests/unit/launcher/test_torch_rdzv.py`` on this torch's c10d handler and on ours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tierckpt.launcher.membership.ranks import Claim, Decided
from tierckpt.launcher.membership.rdzv import TierckptRendezvousHandler

__all__ = ["claim_with", "decided", "joined", "leave_round", "max_nodes_of", "narrow", "regrouped", "standing_by",
           "store_of"]


def store_of(handler: Any) -> Any | None:
    """The job store the handler's rounds live on (the TCPStore under torch's PrefixStore)."""
    if isinstance(handler, TierckptRendezvousHandler):
        return handler.store
    store = getattr(handler, "_store", None)
    return getattr(store, "underlying_store", store)


def narrow(handler: Any, allowed: tuple[int, ...]) -> bool:
    """Rounds close only with a count of ``allowed`` (``elasticPolicy.replicaDiscreteValues``):
    ours can (the arrivals past it wait for the next round); torch's c10d cannot (False)."""
    if isinstance(handler, TierckptRendezvousHandler):
        handler.allowed = tuple(allowed)
        return True
    return False


def claim_with(handler: Any, claim: Callable[[], Claim], timeout_s: float) -> bool:
    """Ours: every arrival registers ``claim()`` and the round's leader applies ``ranks.assign``
    (waiting ``timeout_s`` for a member's registration before it breaks the round); torch's c10d
    handler cannot (False: the launcher exchanges the claims after its round, ranks.exchange_round)."""
    if isinstance(handler, TierckptRendezvousHandler):
        handler.claim, handler.claims_s = claim, timeout_s
        return True
    return False


def decided(handler: Any) -> Decided | None:
    """The decision of the round ``handler`` last returned from, when its leader decided from the claims."""
    return handler.decided if isinstance(handler, TierckptRendezvousHandler) else None


def regrouped(handler: Any, world: int) -> None:
    """The running job now has ``world`` nodes, agreed without a round (change.shrink): ours
    answers ``num_nodes_waiting`` against it; torch's c10d reads its own wait list."""
    if isinstance(handler, TierckptRendezvousHandler) and handler.round is not None:
        handler.world = world


def max_nodes_of(handler: Any) -> int | None:
    if isinstance(handler, TierckptRendezvousHandler):
        return handler.max_nodes
    value = getattr(getattr(handler, "_settings", None), "max_nodes", None)
    return value if isinstance(value, int) else None


def joined(handler: Any) -> tuple[int | None, int | None]:
    """(nodes in the current round so far, nodes needed), or Nones where it cannot be read."""
    if isinstance(handler, TierckptRendezvousHandler):
        try:
            return handler.joined(), handler.min_nodes
        except Exception:  # noqa: BLE001 - a progress line must not break the round
            return None, handler.min_nodes
    holder = getattr(handler, "_state_holder", None)
    state = getattr(holder, "state", None) if holder is not None else None
    participants = getattr(state, "participants", None)
    needed = getattr(getattr(handler, "_settings", None), "min_nodes", None)
    count = len(participants) if isinstance(participants, dict) else None
    return count, needed if isinstance(needed, int) else None


def standing_by(handler: Any) -> int | None:
    """The number of nodes the running round has, if this agent waits in its redundancy list
    (a spare); None otherwise. Ours has no redundancy list: a node that arrives after a round
    closed waits for the next one, and a job at its maximum holds spares at the launcher's gate."""
    if isinstance(handler, TierckptRendezvousHandler):
        return None
    holder = getattr(handler, "_state_holder", None)
    state = getattr(holder, "state", None) if holder is not None else None
    node = getattr(handler, "_this_node", None)
    redundant = getattr(state, "redundancy_list", None)
    participants = getattr(state, "participants", None)
    if node is None or not isinstance(redundant, set) or not isinstance(participants, dict):
        return None
    try:
        return len(participants) if node in redundant else None
    except TypeError:  # an unhashable descriptor in some future torch
        return None


def leave_round(handler: Any) -> bool:
    """Take this agent out of the completed round so that the others' next round does not wait
    for it. Ours: no keep-alive to stop; the agent's next arrival is a newcomer's, not a running
    member's (which would let a round close without the running job, rdzv.py ``rejoined``).
    torch's c10d: stop the keep-alive beat and run the handler's own exit operation (what
    ``next_rendezvous`` runs first); False when a private part is missing (then only the
    keep-alive stops, if it can, and the others wait for its expiry,
    ``keep_alive_interval x keep_alive_max_attempt``)."""
    if isinstance(handler, TierckptRendezvousHandler):
        handler.leave()  # its next round it joins as a newcomer (it re-forms no running job)
        return True
    stop = getattr(handler, "_stop_heartbeats", None)
    if not callable(stop):
        return False
    stop()
    executor = getattr(handler, "_op_executor", None)
    deadline = getattr(handler, "_get_deadline", None)
    timeout = getattr(getattr(getattr(handler, "_settings", None), "timeout", None), "close", None)
    try:
        from torch.distributed.elastic.rendezvous.api import RendezvousError
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp
    except ImportError:
        return False
    if executor is None or not callable(deadline) or timeout is None:
        return False
    try:
        executor.run(_RendezvousExitOp(), deadline(timeout))
    except RendezvousError:  # the store is busy or gone: the stopped keep-alive expires all the same
        return False
    return True
