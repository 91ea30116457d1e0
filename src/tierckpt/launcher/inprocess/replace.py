"""A dead rank replaced alone: the surviving ranks stay in-process, one new process joins them.

When a worker process dies (``Crash``) and every local worker of every node runs under
``tierckpt.resilient`` on the agent-hosted store, the launcher stops nobody: the dead rank's
agent starts a replacement for that local rank only (a warm standby, else cold) with
``TIERCKPT_INPROC_JOIN=<reason>``; the replacement stands in for the dead rank in the
survivors' in-process barrier and joins generation k+1 (``tierckpt.inprocess``). The survivors
keep their interpreters, imports and compiled graphs.

Call order (the agent, one per node):
  1. At every process start: ``StoreHost.env(ctl, node, generation, host)``: the group-rank-0
     agent hosts one TCPStore server (started once, in the agent process, so it outlives any
     worker) and publishes ``host:port`` for the generation; every agent hands its workers
     ``TIERCKPT_INPROC_STORE=host:port/<generation>`` (the generation scopes the keys: a later
     process generation never reads an older one's).
  2. A local ``Crash``, before the claim: ``tag(record, replaceable=..., decision=...)`` marks
     it ``kind="replace"`` when this node's workers can be replaced and the escalation
     decision (the same ``EscalationPolicy.decide``) is a restart: the claim then tells every
     other agent to restart in-process, not to stop.
  3. The claim, on every agent: ``route(fault, node=..., wrapped=..., budget_left=...)``:
     ``REPLACE`` on the dead rank's node (``WarmSubprocessContext.replace``, then wait for every
     local rank's restart record; none within the timeout: the process path), ``INPROCESS``
     elsewhere (and for a hang, a NaN, a log rule), ``PROCESS`` otherwise (a lost node, a crash
     not tagged; the process path applies the escalation decision and may end the job).
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Mapping
from typing import Any

from tierckpt import workerenv
from tierckpt.launcher.control import keys
from tierckpt.launcher.control.store import timeout_error
from tierckpt.launcher.decide.escalation import Action, Decision

__all__ = ["JOIN_ENV", "REPLACE", "Route", "StoreHost", "route", "tag"]

JOIN_ENV = workerenv.INPROC_JOIN  # what supervisor/torch_agent.py sets on a replacement (it imports the name from here)

REPLACE = "replace"  # the claim's kind, the restart event's kind
# faults that change the processes or the membership: never in-process
_PROCESS_FAULTS = frozenset({"Crash", "LostNode", "MembershipChange", "LostStore", "Drain"})


class Route(str, enum.Enum):
    REPLACE = "replace"  # this node's worker died: start one replacement, the rest stay
    INPROCESS = "inprocess"  # every local process stays: an in-process restart
    PROCESS = "process"  # stop the workers; the escalation decision restarts them or ends the job


def tag(record: dict[str, Any], *, replaceable: bool, decision: Decision) -> dict[str, Any]:
    """``record`` (a local fault about to be claimed) with ``kind="replace"`` and the decision's
    backoff when it is a crash this node can replace and ``decision`` restarts; else unchanged."""
    if record.get("reason") != "Crash" or not replaceable or decision.action != Action.RESTART:
        return record
    return {**record, "kind": REPLACE, "delay_s": decision.delay_s, "why": decision.reason}


def route(fault: Mapping[str, Any], *, node: int | None, wrapped: bool, budget_left: bool) -> Route:
    """Which path the claimed ``fault`` takes on the agent of group rank ``node``.

    ``wrapped``: every local worker reported ``ready`` under the wrapper; ``budget_left``: the
    in-process restarts are not used up. A tagged crash is replaced on its node and restarted
    in-process elsewhere; an untagged crash, a lost node or store, a membership change, a
    deadline and a hang of a stopped process take the process path; any other fault goes in-process where the workers allow it.
    """
    reason = str(fault.get("reason", ""))
    # a stopped process (``stopped``: hang.py's first rule) never answers an in-process request
    if not (wrapped and budget_left) or reason.endswith("Deadline") or fault.get("stopped"):
        return Route.PROCESS
    if fault.get("kind") == REPLACE and reason == "Crash":
        return Route.REPLACE if node is not None and fault.get("node") == node else Route.INPROCESS
    return Route.PROCESS if reason in _PROCESS_FAULTS else Route.INPROCESS


class StoreHost:
    """The in-process coordination store of the job, hosted by the group-rank-0 agent."""

    def __init__(self) -> None:
        self._server: Any = None

    def env(self, ctl: Any, node: int, generation: int, host: str, timeout_s: float = 60.0) -> dict[str, str]:
        """``TIERCKPT_INPROC_STORE`` for the workers of ``generation`` (blocks on group rank 0's publication)."""
        import torch.distributed as dist

        key = keys.inproc_store(generation)
        if node == 0:
            if self._server is None:  # one server for the agent's life: it serves every generation
                self._server = dist.TCPStore(host, 0, None, True,  # type: ignore[attr-defined]
                                             timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
            address = f"{host}:{int(self._server.port)}"
            ctl.store.set(key, address.encode())
        else:
            try:
                ctl.store.wait([key], datetime.timedelta(seconds=timeout_s))
            except timeout_error() as exc:
                raise TimeoutError(f"group rank 0 did not publish the in-process store of generation "
                                   f"{generation} within {timeout_s:g}s") from exc
            address = ctl.store.get(key).decode()
        return {workerenv.INPROC_STORE: f"{address}/{generation}"}
