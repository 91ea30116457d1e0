"""Stable group ranks: a node keeps the rank it held across re-rendezvous (its memory tier holds that rank's files).

torch's c10d rendezvous numbers the nodes of a round by sorting their descriptors (host name,
then pid), so a relaunched node (a new, higher pid) can take the survivor's rank, and each
node's memory tier then holds the other rank's checkpoint. As HyperPod's operator assigns
ranks from the job's membership, every agent here publishes a claim (the rank it held last
and whether it held it in this process) in the round's store once torch settled the
membership; torch rank 0 applies the pure ``assign`` to every claim and publishes the result.

Call order (``membership/rounds.py``: ``Rounds.assign`` inside torch's ``_rendezvous``, before the
workers' ranks are assigned; ``Rounds.settled`` once the round formed):

    prior = load_prior(opts, run_id)                    # the rank the last process on this node held
    got = exchange_round(round_store, torch_rank, world, Claim(prior=..., survivor=..., members=..., digest=...))
    got.rank, got.digest                                # O(1): the rank torch's assignment starts from
    save_prior(opts, run_id, got.rank, world)           # for the next process on this node
    before, after = got.memberships()                   # later (settled): O(N) for a node that was not a survivor

``before`` / ``after`` (group rank -> identity) are the membership of the previous round as the
survivors knew it and of this one: ``membership.Change`` names the nodes that left, joined, or
replaced a lost node (a hot spare). A survivor claims the next round with ``after`` and its
``digest``: only torch rank 0 hashes a membership, once per round.
"""

from __future__ import annotations

import hashlib
import json
import socket
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierckpt import layout
from tierckpt.config import DEFAULT_MEMORY_DIR
from tierckpt.errors import ProtocolError
from tierckpt.launcher.control import keys
from tierckpt.launcher.control.store import multi_get_parts, timeout_error, wait_parts
from tierckpt.launcher.supervisor.runstate import STATE_DIR

__all__ = ["CLAIMS_TIMEOUT_S", "Claim", "Decided", "Decision", "RoundBroken", "assign", "broken", "decide",
           "decided_from", "exchange", "exchange_round", "identity", "load_prior", "members_digest", "offer_known",
           "save_prior"]

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
    digest    the name of ``members`` on the wire: the one the last decision gave (``Decided.digest``),
              so a survivor never hashes its map; None: ``members_digest(members)`` (a map settled
              without a decision, a regroup's); a published claim carries only this
    """

    prior: int | None
    survivor: bool = False
    identity: str = ""
    members: Mapping[int, str] | None = None
    digest: str | None = None

    def named(self) -> str | None:
        """The digest this claim names its map by (None: it names none)."""
        if self.digest is not None:
            return self.digest
        return members_digest(self.members) if self.members else None

    def to_json(self) -> bytes:
        """The claim as published: ``members`` by its digest (``offer_known`` publishes the map)."""
        return json.dumps({"prior": self.prior, "survivor": self.survivor, "identity": self.identity,
                           "digest": self.named()}).encode()

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
    return exchange_round(store, torch_rank, world, claim, timeout=timeout).rank


@dataclass(frozen=True, kw_only=True)
class Decided:
    """What torch rank 0 decided, as one node read it: its ``rank`` and the ``digest`` of the new
    membership (what the node names it by when it claims again as a survivor), both O(1) to read;
    the memberships themselves on demand (``memberships``), off the round's critical path."""

    rank: int
    digest: str | None  # members_digest(after), computed once by torch rank 0 (None: an older decider)
    store: Any = field(repr=False)  # the round's store: a newcomer reads the memberships there
    base: Mapping[int, str] | None = field(default=None, repr=False)  # the claim's map, when it is the decision's base
    diff: dict[str, Any] | None = field(default=None, repr=False)  # before and after as differences from ``base``

    def memberships(self) -> tuple[Mapping[int, str], Mapping[int, str]]:
        """(the previous round's membership as the survivors knew it, this round's), group rank ->
        identity. A survivor whose map was the decision's base applies the difference (the map
        itself stands for ``before`` when nothing differs: no copy); any other node reads both
        maps (one ``get``, compressed): O(N), so a caller reads them after its rank is in use."""
        if self.base is not None and self.diff is not None:
            before = _apply(self.base, self.diff["before"])
            return before, _apply(self.base, self.diff["after"])
        full = _unpack(self.store.get(keys.RANK_MEMBERS))
        return _ints(full["before"]), _ints(full["after"])


def exchange_round(store: Any, torch_rank: int, world: int, claim: Claim, *,
                   timeout: float = CLAIMS_TIMEOUT_S) -> Decided:
    """``exchange``, as a ``Decided``: this agent's rank, the new membership's digest and, on
    demand, the memberships (the previous round's as the survivors knew it, this round's).

    O(1) store operations and O(1) work per node, torch rank 0 aside: each node publishes its
    claim (a survivor names the membership it knew by the digest it was told; the first survivor
    with that digest publishes the map once), torch rank 0 reads every claim (``store.multi_get_parts``),
    decides and publishes the decision (every node's rank, the memberships, the new membership's
    digest and the difference from the survivors' map), and each node reads the decision and its
    rank (one ``multi_get``). No node but torch rank 0 hashes or parses a whole membership to get its rank: a survivor
    whose map is the decision's base has the difference in hand, any other node (a newcomer, a
    spare, every node of the first round) reads the whole memberships when it asks for them
    (``Decided.memberships``). Keys: ``keys.py`` "On the store of one rendezvous round".

    A member whose claim does not come within ``timeout`` (it died after it arrived) breaks the
    round: torch rank 0 publishes that instead of a decision, and every member raises
    ``RoundBroken`` (also when torch rank 0 itself publishes nothing within ``timeout`` + 5 s).
    """
    offer_known(store, claim)
    store.set(keys.rank_claim(torch_rank), claim.to_json())
    if torch_rank == 0:
        _decide(store, world, timeout, claim)
    _wait(store, [keys.RANK_DECIDED], timeout + 5.0,
          "the round's first node (torch rank 0) did not publish the round's ranks within {t:.0f}s "
          "after the rendezvous (it failed or left during the round)", broken=True)
    raw, rank_raw = store.multi_get([keys.RANK_DECIDED, keys.rank_decided(torch_rank)])  # one round trip
    return decided_from(bytes(raw), int(bytes(rank_raw)), store, claim)


def offer_known(store: Any, claim: Claim) -> None:
    """A survivor's view of the last round, published once per digest in the round's ``store``:
    the first survivor that names it publishes the map (one ``add`` for the others), for the
    decider of the round (a node that did not know it) to read."""
    digest = claim.named()
    if claim.members is not None and digest is not None:
        if int(store.add(keys.rank_known_count(digest), 1)) == 1:  # the first survivor that knew this map
            store.set(keys.rank_known(digest), _pack({str(k): v for k, v in claim.members.items()}))


def decided_from(raw: bytes, rank: int, store: Any, claim: Claim) -> Decided:
    """One node's ``Decided`` from the round's decision (``RANK_DECIDED``'s value) and its rank;
    raises ``RoundBroken`` when the decider broke the round."""
    decided = json.loads(raw)
    if decided.get("broken"):
        raise RoundBroken(f"round broken: {decided['broken']}")
    digest = claim.named()
    on_base = digest is not None and claim.members is not None and decided.get("base") == digest
    return Decided(rank=rank, digest=decided.get("digest"), store=store,
                   base=claim.members if on_base else None,
                   diff={"before": decided["before"], "after": decided["after"]} if on_base else None)


def broken(why: str) -> bytes:
    """The decision that breaks a round (every member raises ``RoundBroken`` with ``why``)."""
    return json.dumps({"broken": why}).encode()


@dataclass(frozen=True)
class Decision:
    """What a round's decider publishes: the new group rank per torch rank (``order``), the
    memberships (``RANK_MEMBERS``' value) and the decision (``RANK_DECIDED``'s, written last)."""

    order: list[int]
    members: bytes
    decided: bytes


def decide(store: Any, claims: Sequence[Claim], timeout: float, own: Claim | None) -> Decision:
    """``assign`` over every claim (``claims[i]``: torch rank i's), with the previous membership
    merged from the survivors' maps (read from the round's ``store``, ``offer_known``; ``own``: the
    decider's claim, whose map needs no read back); publishes nothing."""
    digests = list(dict.fromkeys(c.digest for c in claims if c.survivor and c.digest))
    known: dict[str, Mapping[int, str]] = {}
    if own is not None and own.members is not None and own.named() in digests:
        known[str(own.named())] = own.members
    unread = [d for d in digests if d not in known]
    _wait(store, [keys.rank_known(d) for d in unread], timeout,
          "a survivor's view of the last round was not published within {t:.0f}s")
    known.update({d: _ints(_unpack(store.get(keys.rank_known(d)))) for d in unread})
    order = assign(claims)
    before = _merged(claims, known)
    after = {order[i]: c.identity for i, c in enumerate(claims)}
    base_digest = digests[0] if digests else None
    members = _pack({"before": {str(k): v for k, v in before.items()}, "after": {str(k): v for k, v in after.items()}})
    decision: dict[str, Any] = {"base": base_digest, "digest": members_digest(after)}
    if base_digest is not None:  # no base (the first round): every node reads RANK_MEMBERS, no difference
        base = known[base_digest]
        decision.update({"before": _diff(before, base), "after": _diff(after, base)})
    return Decision(order=order, members=members, decided=json.dumps(decision).encode())


def members_digest(members: Mapping[int, str]) -> str:
    """A short name for a membership map: survivors that knew the same map send the same digest."""
    raw = json.dumps(sorted(members.items()), separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def _decide(store: Any, world: int, timeout: float, own: Claim) -> None:
    """Torch rank 0: every claim (``store.wait_parts``, ``store.multi_get_parts``), ``assign``, the decision published.
    ``own``: its own claim (a map it names needs no read back, ``decide``)."""
    claimed = [keys.rank_claim(i) for i in range(world)]
    try:
        _wait(store, claimed, timeout, "", broken=True)
    except RoundBroken as exc:
        missing = [i for i, k in enumerate(claimed) if not store.check([k])]
        why = (f"torch rank(s) {missing} of {world} published no rank claim within {timeout:g}s of the round's "
               "close (gone since their arrival, or another tierckpt version)")
        store.multi_set([keys.rank_decided(i) for i in range(world)], [b"-1"] * world)  # each member's read returns
        store.set(keys.RANK_DECIDED, broken(why))
        raise RoundBroken(f"round broken: {why}") from exc
    claims = [Claim.from_json(raw) for raw in multi_get_parts(store, claimed)]
    d = decide(store, claims, timeout, own)
    store.multi_set([keys.rank_decided(i) for i in range(world)], [str(r).encode() for r in d.order])
    store.set(keys.RANK_MEMBERS, d.members)
    store.set(keys.RANK_DECIDED, d.decided)  # last: the wake-up


def _merged(claims: Sequence[Claim], known: Mapping[str, Mapping[int, str]]) -> dict[int, str]:
    """The previous membership from the survivors' maps, merged in torch-rank order (a later one
    wins a rank they disagree on: one may be stale). Every survivor that names the same map counts
    once, at its last place: the same result as merging every survivor's map, in O(N) instead of
    O(N) per survivor."""
    last: dict[str, int] = {}
    inline: list[tuple[int, Mapping[int, str]]] = []
    for i, c in enumerate(claims):
        if c.survivor and c.members:  # an older agent's map, inline
            inline.append((i, c.members))
        elif c.survivor and c.digest:
            last[c.digest] = i
    maps = sorted([(i, known[d]) for d, i in last.items() if d in known] + inline, key=lambda x: x[0])
    before: dict[int, str] = {}
    for _, m in maps:
        before.update(m)
    return before


def _diff(m: Mapping[int, str], base: Mapping[int, str]) -> dict[str, Any]:
    return {"set": {str(k): v for k, v in m.items() if base.get(k) != v}, "drop": [k for k in base if k not in m]}


def _apply(base: Mapping[int, str], d: dict[str, Any]) -> Mapping[int, str]:
    """``base`` with the difference applied; ``base`` itself when there is none (a read-only map)."""
    if not d["set"] and not d["drop"]:
        return base
    out = dict(base)
    for k in d["drop"]:
        out.pop(int(k), None)
    out.update(_ints(d["set"]))
    return out


def _ints(m: dict[str, str]) -> dict[int, str]:
    return {int(k): str(v) for k, v in m.items()}


def _pack(obj: Any) -> bytes:
    return zlib.compress(json.dumps(obj, separators=(",", ":")).encode(), 1)


def _unpack(raw: bytes) -> Any:
    return json.loads(zlib.decompress(bytes(raw)))


def _wait(store: Any, names: list[str], timeout: float, why: str, *, broken: bool = False) -> None:
    try:
        wait_parts(store, names, timeout)
    except timeout_error() as exc:
        if broken:  # named as every broken round is: the launcher's warning says "round broken"
            raise RoundBroken(f"round broken: {why.format(t=timeout)}") from exc
        raise ProtocolError(why.format(t=timeout)) from exc


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
