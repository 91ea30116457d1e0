"""Which own steps this node must keep in memory for the replicas, written where trainers read it.

A lost node's shards come back from its replica; the other ranks then need their own copy of
that same step. So this node protects, in every own namespace of the same base (local mode's
``<ns>--rank<k>`` maps to every local rank's ``<ns>--rank<j>``; global mode's namespace to
itself):

* per (origin, namespace) of the replicas it holds: the newest replica step that is still
  usable here (its own step is held, or not yet written), and every step a put in flight brings;
* per own namespace: the newest step it replicated to its ring targets (so the older replica
  stays offered until a newer one is stored: the sender's keep list still names it).

Cost: one step per origin and namespace beyond ``memory_steps_retained`` (two while a newer
replica is in flight); the steps are mostly the same ones, since ranks save in step.

Call order: ``refresh(state)`` from the agent's round, at a put's admission and after it,
and after a replication; it computes ``wanted(state)`` and rewrites each own namespace's
``.keep`` whose list changed (``tierckpt.node.keep``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from tierckpt.agent import safefs
from tierckpt.errors import TierckptError
from tierckpt.node.keep import write_protected
from tierckpt.observability import get_logger

if TYPE_CHECKING:
    from tierckpt.agent.state import NodeState

__all__ = ["base_namespace", "refresh", "wanted"]

_log = get_logger("agent")
_RANK_SUFFIX = re.compile(r"--rank[0-9]+$")


def base_namespace(ns: str) -> str:
    """The job's namespace: local mode's per-rank suffix removed."""
    return _RANK_SUFFIX.sub("", ns)


def wanted(state: NodeState) -> dict[str, set[int]]:
    """Own namespace → the steps to protect in it (every own namespace present, possibly empty)."""
    store = state.store
    own = store.namespaces()
    own_steps = {ns: _steps(state, ns) for ns in own}
    out: dict[str, set[int]] = {ns: set() for ns in own}

    def protect(replica_ns: str, steps: set[int]) -> None:
        base = base_namespace(replica_ns)
        for ns in own:
            if base_namespace(ns) == base:
                out[ns] |= steps

    in_flight = state.puts_in_flight()
    replicated = state.replicated_steps()
    for origin, ns, step in in_flight:
        if origin != state.node_id:
            protect(ns, {step})
    for origin in store.origins():
        for ns in store.replica_namespaces(origin):
            try:
                held = sorted((s.step for s in store.replica(origin, ns).list_steps()), reverse=True)
            except TierckptError:
                continue
            mine = [own_steps[o] for o in own if base_namespace(o) == base_namespace(ns)]
            usable = [s for s in held if all(s in m or not m or s > max(m) for m in mine)]
            if usable:
                protect(ns, {usable[0]})
    for ns, step in replicated.items():
        if ns in out:
            out[ns].add(step)
    return out


def refresh(state: NodeState) -> None:
    """Rewrite each own namespace's ``.keep`` whose steps changed; failures are logged (retried next round)."""
    with state.protect_lock:
        for ns, steps in wanted(state).items():
            if state.protected.get(ns) == steps:
                continue
            try:
                with safefs.open_dir(state.store.root, state.store.parts("own", state.node_id, ns)) as dfd:
                    write_protected(dfd, steps)
            except OSError as exc:
                _log.warning("[Agent %s] cannot write the protected steps of %s: %s", state.node_id, ns, exc)
                continue
            state.protected[ns] = steps


def _steps(state: NodeState, ns: str) -> set[int]:
    try:
        return {s.step for s in state.store.own(ns).list_steps()}
    except TierckptError:
        return set()
