"""Requests from this node's trainers and tools (the Unix socket): notices, catalog, fetch, status, flush.

The op dispatch; ``catalog`` and ``fetch`` are ``agent.fetch``'s, ``prefetch`` is ``agent.prefetch``'s,
``flush`` is ``agent.drain``'s.

    committed {ns, step}        a step was committed here: wake the replication loop (no reply)
    catalog {ns}                steps and files held by peers and by this node's replicas
    fetch {ns, step, name}      place a verified copy in <memory root>/.peer/<ns>/step_<N>/<name>
    status {}                   what ``tierckpt agent status`` prints
    budget {}                   {budget_bytes, used_bytes}
    make_room {bytes}           evict (node budget order) until ``bytes`` more fit
    flush {ns?}                 copy each namespace's newest step to the durable tier, then reply
    prefetch {ns, ranks}        start pulling these ranks' newest state from peers into .peer/ (prefetch.py);
                                replies at once; a later fetch of a file in flight waits for it
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tierckpt import layout
from tierckpt.agent import protocol as p
from tierckpt.agent.drain import flush, refresh_drain_lag
from tierckpt.agent.fetch import catalog, fetch
from tierckpt.agent.prefetch import parse_ranks, start

if TYPE_CHECKING:
    from tierckpt.agent.state import NodeState

__all__ = ["handle"]

STATUS_DRAIN_CHECK_S = 5.0


def handle(state: NodeState, req: dict[str, Any]) -> dict[str, Any] | None:
    op = req.get("op")
    if op == "committed":
        p.validate_node_id(req.get("ns"))  # namespace charset; the scan re-reads the disk anyway
        state.wake()
        return None
    if op == "catalog":
        return catalog(state, _ns(req))
    if op == "fetch":
        ns, step, name = _ns(req), _step(req), p.validate_file_name(req.get("name"))
        t0 = time.monotonic()
        with state.fetch_lock((ns, step, name)):  # a prefetch of this file in flight holds it: wait
            reply = fetch(state, ns, step, name)
        state.load_waits.note(f"{ns}/{layout.step_dir_name(step)}", name, t0, time.monotonic())
        return reply
    if op == "status":
        if state.config.durable_url is not None:  # someone asked: list the durable tier, at most every few seconds
            refresh_drain_lag(state, list_durable=state.drain_due(STATUS_DRAIN_CHECK_S))
        return {"ok": True, **state.status()}
    if op == "budget":
        return {"ok": True, "budget_bytes": state.config.budget_bytes, "used_bytes": state.store.usage_bytes()}
    if op == "make_room":
        nbytes = req.get("bytes")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise p.ProtocolViolation("bytes must be a whole number >= 0")
        ok = state.enforce_budget(nbytes)
        return {"ok": ok, "budget_bytes": state.config.budget_bytes, "used_bytes": state.store.usage_bytes()}
    if op == "prefetch":
        try:
            ranks = parse_ranks(req.get("ranks"))
        except ValueError as exc:
            raise p.ProtocolViolation(str(exc)) from exc
        job = start(state, _ns(req), ranks)
        return {"ok": True, "started": job.started}
    if op == "flush":
        return flush(state, None if req.get("ns") is None else _ns(req))
    raise p.ProtocolViolation(f"unknown op {str(op)[:32]!r}")


def _ns(req: dict[str, Any]) -> str:
    return p.parse_request({"op": "list", "ns": req.get("ns")}).namespace  # type: ignore[union-attr]


def _step(req: dict[str, Any]) -> int:
    step = req.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= 2**62:
        raise p.ProtocolViolation("step must be a whole number >= 0")
    return step
