"""Stable group ranks: a node keeps the rank it held across re-rendezvous (its memory tier holds that rank's files).

torch's c10d rendezvous numbers the nodes of a round by sorting their descriptors (host name,
then pid), so a relaunched node (a new, higher pid) can take the survivor's rank, and each
node's memory tier then holds the other rank's checkpoint. As HyperPod's operator assigns
ranks from the job's membership, every agent here publishes a claim (the rank it held last
and whether it held it in this process) in the round's store once torch settled the
membership, and every agent applies the same pure ``assign`` to the same claims, so no
coordinator is needed and every node computes the same permutation.

Call order (``TierckptAgent``, inside torch's ``_rendezvous``, before the workers' ranks are
assigned):

    prior = load_prior(opts, run_id)                    # the rank the last process on this node held
    rank, before, after = exchange_round(round_store, torch_rank, world, Claim(prior=..., survivor=..., members=...))
    save_prior(opts, run_id, rank, world)               # for the next process on this node

``before`` / ``after`` (group rank -> identity) are the membership of the previous round as the
survivors knew it and of this one: ``membership.Change`` names the nodes that left, joined, or
replaced a lost node (a hot spare).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierckpt import layout
from tierckpt.config import DEFAULT_MEMORY_DIR
from tierckpt.errors import ProtocolError
from tierckpt.launcher.control import keys
from tierckpt.launcher.supervisor.runstate import STATE_DIR

__all__ = ["Claim", "assign", "exchange", "exchange_round", "identity", "load_prior", "save_prior"]


@dataclass(frozen=True, kw_only=True)
class Claim:
    """What one agent asks for in a rendezvous round.

    prior     the group rank this node held last (None: none known, a new machine)
    survivor  the rank was held by this very process (not read back from a file): it wins a
              conflict, since its workers' memory tier certainly holds that rank's files
    identity  host and memory root: names the node in events, and for ``offenders.py``
    members   a survivor's view of the previous round's membership (group rank -> identity);
              None for an agent that held no rank in this process (a new, relaunched or spare node)
    """

    prior: int | None
    survivor: bool = False
    identity: str = ""
    members: dict[int, str] | None = None

    def to_json(self) -> bytes:
        members = None if self.members is None else {str(k): v for k, v in self.members.items()}
        return json.dumps({"prior": self.prior, "survivor": self.survivor, "identity": self.identity,
                           "members": members}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Claim:
        d = json.loads(raw)
        prior = d.get("prior")
        members = d.get("members")
        return cls(prior=None if prior is None else int(prior), survivor=bool(d.get("survivor")),
                   identity=str(d.get("identity", "")),
                   members=None if not isinstance(members, dict) else {int(k): str(v) for k, v in members.items()})


def assign(claims: Sequence[Claim]) -> list[int]:
    """New group rank per torch rank (``claims[i]`` is torch rank i's claim); a permutation of 0..n-1.

    Survivors keep their rank first, then nodes that remember one (in torch-rank order), then
    the rest fill the free ranks in torch-rank order. A prior outside 0..n-1 (the job shrank)
    is ignored.
    """
    n = len(claims)
    out: list[int | None] = [None] * n
    taken: set[int] = set()
    for i in sorted(range(n), key=lambda i: (not claims[i].survivor, i)):
        p = claims[i].prior
        if p is not None and 0 <= p < n and p not in taken:
            out[i] = p
            taken.add(p)
    free = iter(r for r in range(n) if r not in taken)
    return [r if r is not None else next(free) for r in out]


def exchange(store: Any, torch_rank: int, world: int, claim: Claim, *, timeout: float = 120.0) -> int:
    """Publish this agent's claim in the round's store, read every claim, return this agent's rank.

    ``store`` is the round's store (torch's ``PrefixStore`` per round), so claims of an older
    round are never read.
    """
    return exchange_round(store, torch_rank, world, claim, timeout=timeout)[0]


def exchange_round(store: Any, torch_rank: int, world: int, claim: Claim, *,
                   timeout: float = 120.0) -> tuple[int, dict[int, str], dict[int, str]]:
    """``exchange``, plus the memberships: (this agent's rank, the previous round's membership as
    the survivors knew it, this round's membership), each group rank -> identity."""
    store.set(keys.rank_claim(torch_rank), claim.to_json())
    claimed = [keys.rank_claim(i) for i in range(world)]
    deadline = time.monotonic() + timeout
    while not store.check(claimed):
        if time.monotonic() > deadline:
            raise ProtocolError(f"not every node published its rank claim within {timeout:.0f}s after the "
                                "rendezvous; check that every node runs the same tierckpt version")
        time.sleep(0.01)
    claims = [Claim.from_json(store.get(k)) for k in claimed]
    order = assign(claims)
    before: dict[int, str] = {}
    for c in claims:  # every survivor knew the same previous membership; merge in case one is stale
        if c.survivor and c.members:
            before.update(c.members)
    after = {order[i]: c.identity for i, c in enumerate(claims)}
    return order[torch_rank], before, after


def _path(memory_dir: str | None, run_id: str) -> Path:
    return Path(memory_dir or DEFAULT_MEMORY_DIR) / STATE_DIR / f"{run_id}.rank.json"


def identity(memory_dir: str | None) -> str:
    return f"{socket.gethostname()}:{memory_dir or DEFAULT_MEMORY_DIR}"


def load_prior(memory_dir: str | None, run_id: str) -> int | None:
    """The group rank the last agent of this job on this memory root held (None when unknown)."""
    try:
        d = json.loads(_path(memory_dir, run_id).read_text())
        return int(d["group_rank"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def save_prior(memory_dir: str | None, run_id: str, rank: int, world: int) -> str | None:
    """Remember this node's group rank beside its memory tier; the error's text when it cannot
    (the caller warns: a relaunch then takes whatever rank torch gives it)."""
    p = _path(memory_dir, run_id)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        layout.write_atomic(p, json.dumps({"group_rank": rank, "group_world_size": world}))
    except OSError as exc:
        return f"cannot keep this node's group rank in {p}: {exc}"
    return None
