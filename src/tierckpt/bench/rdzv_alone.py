"""The rank decision's own cost at N nodes with no simulator beside it: ``bench rdzv``'s separation of
the protocol from the simulation of N agents on a few cores.

On the bench's store (a run id or a prefix of its own), per round, N-1 members' registrations are
published first, as N-1 agents would have published them, then one node's part is timed alone:

- ``lead_s``: ``--rdzv-backend tierckpt``'s round leader deciding the round (membership/rdzv.py
  ``_rank``: every member's descriptor with its claim waited for and read in ``KEYS_PER_CALL``
  parts, ``ranks.decide``, the decision and every member's rank published);
- ``member_s``: one member's read of its rank and the decision after the round closed;
- ``exchange_s``: torch rank 0's ``ranks.exchange_round``, the exchange that follows a round of
  torch's c10d backend (the claims published the same way; ``rank0_s`` before stop 37).

Two rounds each: the first (no node holds a rank) and a lost node's (N-1 survivors naming the last
membership by digest; the spare, a newcomer; rank N/2's holder gone: it holds the lost rank).

Call order: ``exchange_alone(port, n)`` while the store on ``port`` runs; nothing is left behind
but the run ids' and prefixes' keys.
"""

from __future__ import annotations

import datetime
import time
import uuid
from typing import Any

from tierckpt.launcher.control import keys
from tierckpt.launcher.membership.ranks import (
    Claim,
    decided_from,
    exchange_round,
    members_digest,
    offer_known,
)
from tierckpt.launcher.membership.rdzv import TierckptRendezvousHandler

__all__ = ["exchange_alone"]


def _ident(i: int) -> str:
    return f"sim{i:05d}:/dev/shm/tierckpt"


def exchange_alone(port: int, n: int) -> dict[str, Any]:
    """Seconds the tierckpt leader, one member and c10d's exchange (torch rank 0) take at ``n`` nodes, per round."""
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", port, is_master=False,  # type: ignore[attr-defined]
                           timeout=datetime.timedelta(seconds=60))
    last = {i: _ident(i) for i in range(n)}
    digest = members_digest(last)
    lost = n // 2
    out: dict[str, Any] = {}
    for name in ("first", "lost"):
        def claim(i: int, name: str = name) -> Claim:
            """Torch rank i's claim (host order is arrival order here: one host, one pid)."""
            if name == "first":
                return Claim(prior=None, identity=_ident(i))
            if i == n - 1:  # the spare: a newcomer
                return Claim(prior=None, identity=_ident(n))
            prior = i if i < lost else i + 1  # the survivors, rank N/2's holder gone
            return Claim(prior=prior, survivor=True, identity=_ident(prior), members=last, digest=digest)

        # the tierckpt round: arrivals 1..N-1 registered, arrival 0 leads
        h = TierckptRendezvousHandler(client, f"alone-{uuid.uuid4().hex}", min_nodes=n, max_nodes=n)
        if name == "lost":  # the first survivor with the digest publishes the map
            offer_known(h._round_store(0), claim(1))
        who = [f"{h._host}\n0\n" + claim(i).to_json().decode() for i in range(n)]
        client.multi_set([h._r(0, f"who/{i}") for i in range(n)], who)  # type: ignore[attr-defined]
        client.check([h._r(0, "who/0")])  # a reply: the server has stored every descriptor (set has none)
        t0 = time.perf_counter()
        by_claims = h._rank(0, n, time.monotonic() + 60, 0.5, claim(0))
        t1 = time.perf_counter()
        rank_raw, raw = client.multi_get([h._r(0, f"rank/{n - 1}"), h._round_key(0, keys.RANK_DECIDED)])
        member = decided_from(bytes(raw), int(bytes(rank_raw)), h._round_store(0), claim(n - 1))
        t2 = time.perf_counter()
        leader = int(client.get(h._r(0, "rank/0")))
        # torch's c10d round, then the exchange
        store = dist.PrefixStore(f"alone/{uuid.uuid4().hex}/", client)  # type: ignore[attr-defined]
        store.multi_set([keys.rank_claim(i) for i in range(1, n)], [claim(i).to_json() for i in range(1, n)])  # type: ignore[attr-defined]
        store.check([keys.rank_claim(n - 1)])
        t3 = time.perf_counter()
        zero = exchange_round(store, 0, n, claim(0))
        t4 = time.perf_counter()
        out[name] = {"lead_s": round(t1 - t0, 4), "member_s": round(t2 - t1, 4), "exchange_s": round(t4 - t3, 4),
                     # the first round: any two distinct ranks; a lost node's: the survivor keeps its rank,
                     # the spare holds the lost one's
                     "ok": by_claims and zero.rank == leader and (
                         (leader, member.rank) == (0, lost) if name == "lost"
                         else leader != member.rank and {leader, member.rank} <= set(range(n)))}
    return out

