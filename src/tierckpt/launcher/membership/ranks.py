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

import datetime
import hashlib
import json
import socket
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierckpt import layout
from tierckpt.config import DEFAULT_MEMORY_DIR
from tierckpt.errors import ProtocolError
from tierckpt.launcher.control import keys
from tierckpt.launcher.control.store import timeout_error
from tierckpt.launcher.supervisor.runstate import STATE_DIR

__all__ = ["CLAIMS_TIMEOUT_S", "Claim", "RoundBroken", "assign", "exchange", "exchange_round", "identity",
           "load_prior", "members_digest", "save_prior"]

#: how long torch rank 0 waits for every member's claim after the round closed (a live member
#: claims within milliseconds of its return from the round): a member that died between its
#: arrival and the close breaks the round, and every member joins the next one (``RoundBroken``)
CLAIMS_TIMEOUT_S = 15.0


class RoundBroken(ProtocolError):
    """A member of the round never claimed its rank (it died after it arrived): every member
    leaves the round and joins the next one (``Rounds.rendezvous`` retries)."""


@dataclass(frozen=True, kw_only=True)
class Claim:
    """What one agent asks for in a rendezvous round.

    prior     the group rank this node held last (None: none known, a new machine)
    survivor  the rank was held by this very process (not read back from a file): it wins a
              conflict, since its workers' memory tier certainly holds that rank's files
    identity  host and memory root: names the node in events, and for ``offenders.py``
    members   a survivor's view of the previous round's membership (group rank -> identity);
              None for an agent that held no rank in this process (a new, relaunched or spare node)
    digest    what a published claim carries instead of ``members`` (``members_digest``)
    """

    prior: int | None
    survivor: bool = False
    identity: str = ""
    members: dict[int, str] | None = None
    digest: str | None = None  # on the wire: ``members_digest(members)``; the map itself travels once

    def to_json(self, digest: str | None = None) -> bytes:
        """The claim as published: ``members`` by its digest (``exchange_round`` publishes the map)."""
        if digest is None and self.members:
            digest = members_digest(self.members)
        return json.dumps({"prior": self.prior, "survivor": self.survivor, "identity": self.identity,
                           "digest": digest or self.digest}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Claim:
        d = json.loads(raw)
        prior = d.get("prior")
        members = d.get("members")  # an older agent sent its map inline
        digest = d.get("digest")
        return cls(prior=None if prior is None else int(prior), survivor=bool(d.get("survivor")),
                   identity=str(d.get("identity", "")),
                   members=None if not isinstance(members, dict) else {int(k): str(v) for k, v in members.items()},
                   digest=str(digest) if digest else None)


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


def exchange(store: Any, torch_rank: int, world: int, claim: Claim, *, timeout: float = CLAIMS_TIMEOUT_S) -> int:
    """Publish this agent's claim in the round's store, return this agent's rank (``exchange_round``).

    ``store`` is the round's store (torch's ``PrefixStore`` per round), so claims of an older
    round are never read.
    """
    return exchange_round(store, torch_rank, world, claim, timeout=timeout)[0]


def exchange_round(store: Any, torch_rank: int, world: int, claim: Claim, *,
                   timeout: float = CLAIMS_TIMEOUT_S) -> tuple[int, dict[int, str], dict[int, str]]:
    """``exchange``, plus the memberships: (this agent's rank, the previous round's membership as
    the survivors knew it, this round's membership), each group rank -> identity.

    O(1) store operations per node: each node publishes its claim (a survivor names the
    membership it knew by digest; the first survivor with that digest publishes the map once),
    torch rank 0 reads every claim in one ``multi_get`` and publishes the decision (every node's
    rank, the memberships), and each node reads its rank and the memberships. A survivor whose
    map is the decision's base reads only the difference (the nodes that left or joined); a node
    without it (a newcomer, a spare) reads the whole memberships, compressed. Keys: ``keys.py``
    "On the store of one rendezvous round".

    A member whose claim does not come within ``timeout`` (it died after it arrived) breaks the
    round: torch rank 0 publishes that instead of a decision, and every member raises
    ``RoundBroken`` (also when torch rank 0 itself publishes nothing within ``timeout`` + 5 s).
    """
    digest = None
    if claim.members:
        digest = members_digest(claim.members)
        if int(store.add(keys.rank_known_count(digest), 1)) == 1:  # the first survivor that knew this map
            store.set(keys.rank_known(digest), _pack({str(k): v for k, v in claim.members.items()}))
    store.set(keys.rank_claim(torch_rank), claim.to_json(digest))
    if torch_rank == 0:
        _decide(store, world, timeout)
    _wait(store, [keys.RANK_DECIDED], timeout + 5.0,
          "the round's first node (torch rank 0) did not publish the round's ranks within {t:.0f}s "
          "after the rendezvous (it failed or left during the round)", broken=True)
    decided = json.loads(store.get(keys.RANK_DECIDED))
    if decided.get("broken"):
        raise RoundBroken(f"round broken: {decided['broken']}")
    rank_raw = store.get(keys.rank_decided(torch_rank))
    if digest is not None and claim.members is not None and decided.get("base") == digest:
        before = _apply(claim.members, decided["before"])
        after = _apply(claim.members, decided["after"])
    else:
        full = _unpack(store.get(keys.RANK_MEMBERS))
        before, after = _ints(full["before"]), _ints(full["after"])
    return int(rank_raw), before, after


def members_digest(members: dict[int, str]) -> str:
    """A short name for a membership map: survivors that knew the same map send the same digest."""
    raw = json.dumps(sorted(members.items()), separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def _decide(store: Any, world: int, timeout: float) -> None:
    """Torch rank 0: every claim (one wait, one multi_get), ``assign``, the decision published."""
    claimed = [keys.rank_claim(i) for i in range(world)]
    try:
        _wait(store, claimed, timeout, "", broken=True)
    except RoundBroken as exc:
        missing = [i for i, k in enumerate(claimed) if not store.check([k])]
        why = (f"torch rank(s) {missing} of {world} published no rank claim within {timeout:g}s of the round's "
               "close (gone since their arrival, or another tierckpt version)")
        store.set(keys.RANK_DECIDED, json.dumps({"broken": why}).encode())
        raise RoundBroken(f"round broken: {why}") from exc
    claims = [Claim.from_json(bytes(raw)) for raw in store.multi_get(claimed)]
    digests = list(dict.fromkeys(c.digest for c in claims if c.survivor and c.digest))
    _wait(store, [keys.rank_known(d) for d in digests], timeout,
          "a survivor's view of the last round was not published within {t:.0f}s")
    known = {d: _ints(_unpack(store.get(keys.rank_known(d)))) for d in digests}
    order = assign(claims)
    before: dict[int, str] = {}
    for c in claims:  # every survivor knew the same previous membership; merge in case one is stale
        if c.survivor:
            before.update(c.members or known.get(c.digest or "", {}))
    after = {order[i]: c.identity for i, c in enumerate(claims)}
    base_digest = digests[0] if digests else None
    base = known.get(base_digest or "", {})
    store.multi_set([keys.rank_decided(i) for i in range(world)], [str(r).encode() for r in order])
    store.set(keys.RANK_MEMBERS, _pack({"before": {str(k): v for k, v in before.items()},
                                        "after": {str(k): v for k, v in after.items()}}))
    store.set(keys.RANK_DECIDED, json.dumps({"base": base_digest, "before": _diff(before, base),
                                             "after": _diff(after, base)}).encode())  # last: the wake-up


def _diff(m: dict[int, str], base: dict[int, str]) -> dict[str, Any]:
    return {"set": {str(k): v for k, v in m.items() if base.get(k) != v}, "drop": [k for k in base if k not in m]}


def _apply(base: dict[int, str], d: dict[str, Any]) -> dict[int, str]:
    out = {k: v for k, v in base.items() if k not in set(d["drop"])}
    out.update(_ints(d["set"]))
    return out


def _ints(m: dict[str, str]) -> dict[int, str]:
    return {int(k): str(v) for k, v in m.items()}


def _pack(obj: Any) -> bytes:
    return zlib.compress(json.dumps(obj, separators=(",", ":")).encode(), 1)


def _unpack(raw: bytes) -> Any:
    return json.loads(zlib.decompress(bytes(raw)))


def _wait(store: Any, names: list[str], timeout: float, why: str, *, broken: bool = False) -> None:
    if not names:
        return
    try:
        store.wait(names, datetime.timedelta(seconds=timeout))
    except timeout_error() as exc:
        raise (RoundBroken if broken else ProtocolError)(why.format(t=timeout)) from exc


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
