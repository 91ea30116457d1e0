"""Enforcing ``maxNumRepeatOffendersToAvoid``: the job-store shell around ``offenders.OffenderPolicy``.

At each restart decision that stops every node's workers (all of them acked the stop barrier,
so the offender is alive and present), every agent calls ``RepeatOffenders.keep_out``:

1. the fault of generation ``g`` is **attributed** to the identity its claim's node had in the
   membership of ``g`` (``offenders.attribute``) and merged into one job-store key,
   ``tierckpt/run/offenses`` (a JSON object ``{generation: {"identity", "time", "reason"}}``,
   updated by compare-and-set; the same entry from every agent, so the merge is idempotent);
2. the first agent to get there computes ``OffenderPolicy.exclude(faults, spares=<spares at
   the gate>)`` and publishes it under ``tierckpt/run/keep-out/<g>`` (compare-and-set: the first
   answer is everyone's, though agents read the gate's count at different moments);
3. every agent gets the group ranks whose identity is kept out. The agents of those ranks stand
   aside (``leave_round``, then the spare gate), the others open one seat per such rank and go
   through torch's rendezvous round, where the waiting spares take the free ranks (``ranks.py``).

The offenses are also kept in the restart-state file (``remembered`` / ``remember``), so that a
full job restart (a new store) still knows them: every agent merges its own into the new store
after the first rendezvous round.

At a **full job restart** (``FULL_RESTART``, exit 75) the next start should avoid the offenders:
``at_full_restart`` agrees (first answer wins, ``tierckpt/run/keep-out/full/<g>``) on at most
``maxNumRepeatOffendersToAvoid`` of them, with no spare cap (the scheduler supplies the nodes,
offenders.py), each as an ``Avoided`` (identity, the scheduler's name of its machine as the node
published it with ``publish_machine``, faults in the window). The agent writes them to the
restart-state file (``avoid``), as ``offender`` events (``at: "full_restart"``) and to the
scheduler's hint file (``write_avoid_file``: one machine name a line). At the next start an
agent that finds itself in that list (``avoided``; the list of its own state file, merged with
the one the first agent published in the new store, ``agree_avoid``) waits at the spare gate as
an offender: it takes no first-round seat for ``AvoidSettings.wait_s`` (other nodes take them),
then stands behind every other spare; a seat still free when that wait ends is its own.

Nodes whose health checks fail (detect/healthwatch.py) are kept out the same way, before any
offender and whether or not the offender policy is on: the node marks itself in
``tierckpt/run/unhealthy-nodes`` (``mark_unhealthy``; ``clear_unhealthy`` when it passes again),
``keep_out`` puts those identities first (as many as there are spares), and ``at_full_restart``
puts them first in the avoid list. Their faults are not offenses (a drain is no fault).

Call order (``TierckptAgent``):

    avoid = RepeatOffenders(OffenderPolicy.from_restart_policy(run_policy.restart_policy))
    avoid.remember(job_store, state.get("offenses"))               # after each rendezvous round
    avoid.record(job_store, g, fault, members)                     # at every fault claim
    out = avoid.keep_out(job_store, g, fault, members, spares=spares_waiting(job_store))  # a restart, all stopped
    ...an agent whose rank is in ``out``: events "offender"; leave_round(handler); the spare gate
    state["offenses"] = avoid.remembered                           # with every restart-state save
    publish_machine(job_store, identity, machine)                  # after each rendezvous round
    out = avoid.at_full_restart(job_store, g)                      # a FULL_RESTART decision, before the exit barrier
    write_avoid_file(settings.file, out); state["avoid"] = [a.to_dict() for a in out]
    ...the next start, before the spare gate:
    me = avoided(agree_avoid(job_store, state.get("avoid")), identity, settings)   # None: not avoided
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.launcher.control import keys
from tierckpt.launcher.control.store import peek
from tierckpt.launcher.decide.offenders import NodeFault, OffenderPolicy, attribute

__all__ = ["Avoided", "AvoidSettings", "KeepOut", "RepeatOffenders", "agree_avoid", "avoided", "clear_unhealthy",
           "mark_unhealthy", "publish_machine", "unhealthy_nodes", "write_avoid_file"]


@dataclass(frozen=True, kw_only=True)
class AvoidSettings:
    """Repeat offenders at full job restarts (``tierckpt run`` options; see the module doc).

    file      the scheduler's hint (``--avoid-file`` / ``$TIERCKPT_AVOID_FILE``): rewritten at every
              full job restart with one machine name a line (empty: none avoided); None: not written
    wait_s    how long a relaunched offender leaves the first round's seats to other nodes before
              it takes a free one itself (``--avoid-wait``); 0: it does not wait
    machine   the scheduler's name for this node's machine (``$TIERCKPT_NODE_NAME``: the Kubernetes
              node, from the downward API; Slurm's node name). Given, a node is avoided by machine
              (a recreated pod keeps its host name but may land elsewhere); "": by identity
              (``host:memory root``), and the host name stands for the machine in the hint
    """

    file: str | None = None
    wait_s: float = 120.0
    machine: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.wait_s, bool) or not isinstance(self.wait_s, (int, float)) \
                or not math.isfinite(self.wait_s) or self.wait_s < 0:
            raise ConfigError(f"--avoid-wait must be 0 or more seconds, got {self.wait_s!r}")
        if self.file is not None and not self.file:
            raise ConfigError("--avoid-file must name a file (or leave it out)")

    def machine_name(self) -> str:
        return self.machine or socket.gethostname()


@dataclass(frozen=True)
class Avoided:
    """One node the next start avoids: its identity, its machine's name, its faults in the window."""

    identity: str
    machine: str
    faults: int

    def to_dict(self) -> dict[str, Any]:
        return {"identity": self.identity, "machine": self.machine, "faults": self.faults}

    @classmethod
    def parse(cls, raw: Any) -> list[Avoided]:
        """The entries of a restart-state file's or the store's ``avoid`` list; damaged ones dropped."""
        if not isinstance(raw, list):
            return []
        return [cls(str(e["identity"]), str(e["machine"]), int(e["faults"])) for e in raw
                if isinstance(e, dict) and isinstance(e.get("identity"), str) and isinstance(e.get("machine"), str)
                and isinstance(e.get("faults"), int) and not isinstance(e.get("faults"), bool)]


@dataclass(frozen=True)
class KeepOut:
    """The agreed answer for one generation: the group ranks to do without, their identities, and
    the spares waiting at the gate when the first agent decided."""

    ranks: tuple[int, ...] = ()
    identities: tuple[str, ...] = ()
    spares: int = 0
    unhealthy: tuple[str, ...] = ()  # the identities kept out for failing health checks, not as offenders

    def __bool__(self) -> bool:
        return bool(self.ranks)


class RepeatOffenders:
    """Attributed faults in the job store and the agreed keep-out list per generation; see the module doc."""

    def __init__(self, policy: OffenderPolicy) -> None:
        self.policy = policy
        self.remembered: dict[str, dict[str, Any]] = {}  # the offenses as last read (for the state file)

    @property
    def enabled(self) -> bool:
        return self.policy.max_avoid > 0

    def remember(self, store: Any, offenses: Any) -> None:
        """Merge offenses kept in this node's restart-state file into the job store (after a round)."""
        if not self.enabled or not isinstance(offenses, dict) or not offenses:
            return
        clean = {str(g): dict(v) for g, v in offenses.items()
                 if isinstance(v, dict) and isinstance(v.get("identity"), str) and isinstance(v.get("time"), (int, float))}
        self.remembered = _merge(store, keys.OFFENSES, lambda cur: {**clean, **cur})

    def record(self, store: Any, generation: int, fault: dict[str, Any], members: Mapping[int, str]) -> None:
        """Attribute ``fault`` (the claim of ``generation``) to its node's identity in ``members``
        (this round's rank -> identity) and merge it into the store; at every fault, whatever the
        decision, so that a full job restart keeps it (the state file saves ``remembered``)."""
        if not self.enabled:
            return
        entry = {str(generation): {"identity": f.identity, "time": f.time, "reason": str(fault.get("reason"))}
                 for f in attribute([fault], [members])}
        self.remembered = _merge(store, keys.OFFENSES, lambda cur: {**cur, **entry}) if entry else _read(store, keys.OFFENSES)

    def keep_out(self, store: Any, generation: int, fault: dict[str, Any], members: Mapping[int, str], *,
                 spares: int, unhealthy: Sequence[str] = ()) -> KeepOut:
        """The group ranks (of ``members``) that the next round must do without; the same answer on
        every agent. Records ``fault`` first (``record``; the same entry twice writes nothing).
        ``unhealthy``: identities whose health checks fail (``unhealthy_nodes``): kept out before
        any repeat offender, as many as there are spares, whether or not the offender policy is on."""
        sick = [i for i in unhealthy if i in members.values()]
        if not self.enabled and not sick:
            return KeepOut()
        self.record(store, generation, fault, members)
        offenders = [i for i in self.policy.exclude(self.faults(), spares=spares) if i not in sick]
        out = (sick + offenders)[:max(0, spares)]
        mine = json.dumps({"out": out, "spares": spares, "unhealthy": [i for i in out if i in sick]}).encode()
        agreed = json.loads(bytes(store.compare_set(keys.keep_out(generation), b"", mine)))
        ranks = tuple(sorted(rank for rank, ident in members.items() if ident in agreed["out"]))
        return KeepOut(ranks, tuple(members[r] for r in ranks), int(agreed["spares"]),
                       unhealthy=tuple(agreed.get("unhealthy") or ()))

    def at_full_restart(self, store: Any, generation: int) -> list[Avoided]:
        """The nodes the next start of the job avoids (``OffenderPolicy.avoid_at_full_restart`` on
        the offenses in the store, after every node whose health checks fail: ``unhealthy_nodes``),
        the same on every agent: the first answer for ``generation`` wins. Called before the exit
        barrier, while the store is up; if it is gone, this agent's own answer from the offenses it
        last read (``RuntimeError``: torch's ``DistError``)."""
        try:
            sick = list(unhealthy_nodes(store))
            if not self.enabled and not sick:
                return []
            self.remembered = {**self.remembered, **_read(store, keys.OFFENSES)}
            mine = self._avoided(lambda ident: _read_text(store, keys.machine(ident)), sick)
            body = json.dumps([a.to_dict() for a in mine]).encode()
            return Avoided.parse(json.loads(bytes(store.compare_set(keys.keep_out_full(generation), b"", body))))
        except RuntimeError:
            return self._avoided(lambda ident: None, []) if self.enabled else []

    def _avoided(self, machine_of: Callable[[str], str | None], sick: Sequence[str]) -> list[Avoided]:
        offenders = self.policy.avoid_at_full_restart(self.faults()) if self.enabled else []
        return [Avoided(ident, machine_of(ident) or ident.split(":", 1)[0], self.count(ident))
                for ident in [*sick, *(i for i in offenders if i not in sick)]]

    def faults(self) -> list[NodeFault]:
        """The attributed faults as last read, oldest first."""
        return sorted((NodeFault(str(v["identity"]), float(v["time"])) for v in self.remembered.values()),
                      key=lambda f: (f.time, f.identity))

    def count(self, identity: str) -> int:
        """Faults attributed to ``identity`` within the policy's window (for the ``offender`` event)."""
        faults = self.faults()
        if not faults:
            return 0
        newest = max(f.time for f in faults)
        window = self.policy.window_s
        return sum(1 for f in faults if f.identity == identity and (window is None or f.time >= newest - window))


def mark_unhealthy(store: Any, identity: str, detail: str, now: float) -> None:
    """This node's health checks fail (``detail``): the next restart keeps it out where a spare can
    take its rank, a full job restart avoids it (one compare-and-set loop)."""
    _merge(store, keys.UNHEALTHY_NODES, lambda cur: {**cur, identity: {"detail": detail, "time": now}}
           if identity not in cur else cur)


def clear_unhealthy(store: Any, identity: str) -> None:
    """This node's health checks pass again."""
    _merge(store, keys.UNHEALTHY_NODES, lambda cur: {k: v for k, v in cur.items() if k != identity})


def unhealthy_nodes(store: Any) -> dict[str, dict[str, Any]]:
    """The nodes whose health checks fail now, by identity, oldest first (one store read)."""
    return dict(sorted(_read(store, keys.UNHEALTHY_NODES).items(), key=lambda kv: float(kv[1].get("time", 0))))


def publish_machine(store: Any, identity: str, machine: str) -> None:
    """This node's machine name under its identity, for the avoid list of a full job restart
    (after each rendezvous round; one store operation)."""
    store.set(keys.machine(identity), machine.encode())


def agree_avoid(store: Any, mine: Any) -> list[Avoided]:
    """Before the spare gate of a start: the avoid list of this node's restart-state file, merged
    with the one the first agent of this start published (which this call publishes when it is
    the first with one), so a node whose state file lacks the list still learns it."""
    own = Avoided.parse(mine)
    key_body = json.dumps([a.to_dict() for a in own]).encode()
    raw = bytes(store.compare_set(keys.AVOID, b"", key_body)) if own else peek(store, keys.AVOID)
    try:
        theirs = Avoided.parse(json.loads(raw)) if raw is not None else []
    except ValueError:
        theirs = []
    seen = {a.identity for a in own}
    return own + [a for a in theirs if a.identity not in seen]


def avoided(entries: Sequence[Avoided], identity: str, settings: AvoidSettings) -> Avoided | None:
    """This node's entry in the avoid list: by machine when the scheduler names it, else by identity."""
    for a in entries:
        if (a.machine == settings.machine) if settings.machine else (a.identity == identity):
            return a
    return None


def write_avoid_file(path: str, entries: Sequence[Avoided]) -> None:
    """The scheduler's hint: one machine name a line (none: an empty file), replaced atomically
    through a temporary file of a unique name beside it (every agent of the job may write it)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    machines = list(dict.fromkeys(a.machine for a in entries))
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{m}\n" for m in machines))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_text(store: Any, key: str) -> str | None:
    raw = peek(store, key)
    return None if raw is None else raw.decode()


def _read(store: Any, key: str) -> dict[str, dict[str, Any]]:
    raw = peek(store, key)
    return {} if raw is None else dict(json.loads(raw))


def _merge(store: Any, key: str, update: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """Compare-and-set ``key`` (a JSON object) to ``update(current)`` until no other agent raced it."""
    while True:
        raw = peek(store, key)
        cur = {} if raw is None else dict(json.loads(raw))
        new = update(cur)
        if new == cur:
            return cur
        body = json.dumps(new, sort_keys=True).encode()
        if bytes(store.compare_set(key, b"" if raw is None else raw, body)) == body:
            return new


