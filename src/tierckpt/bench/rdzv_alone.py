"""The rank exchange's own cost at N nodes with no simulator beside it: ``bench rdzv``'s
separation of the protocol from the simulation of N agents on a few cores.

On the bench's store (a prefix of its own), the claims of torch ranks 1..N-1 are published first,
as N-1 members would have published them; then torch rank 0's ``ranks.exchange_round`` is timed
alone (its claim, for a survivor the map it knew, the wait for every claim and their read in
``KEYS_PER_CALL`` parts, ``assign``, the decision published), then one member's (its claim, the wait, one
``multi_get``). Two rounds: the first (no node holds a rank) and a lost node's (N-1 survivors
naming the last membership by digest; the spare, a newcomer, last; rank N/2's holder gone).

Call order: ``exchange_alone(port, n)`` while the store on ``port`` runs; nothing is left behind
but the prefix's keys.
"""

from __future__ import annotations

import datetime
import time
import uuid
from typing import Any

from tierckpt.launcher.control import keys
from tierckpt.launcher.membership.ranks import Claim, exchange_round, members_digest

__all__ = ["exchange_alone"]


def _ident(i: int) -> str:
    return f"sim{i:05d}:/dev/shm/tierckpt"


def exchange_alone(port: int, n: int) -> dict[str, Any]:
    """Seconds torch rank 0 and one member spend in ``exchange_round`` at ``n`` nodes, per round."""
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", port, is_master=False,  # type: ignore[attr-defined]
                           timeout=datetime.timedelta(seconds=60))
    last = {i: _ident(i) for i in range(n)}
    digest = members_digest(last)
    lost = n // 2
    out: dict[str, Any] = {}
    for name in ("first", "lost"):
        store = dist.PrefixStore(f"alone/{uuid.uuid4().hex}/", client)  # type: ignore[attr-defined]

        def claim(i: int, name: str = name) -> Claim:
            if name == "first":
                return Claim(prior=None, identity=_ident(i))
            if i == n - 1:  # the spare takes the last torch rank: a newcomer
                return Claim(prior=None, identity=_ident(n))
            prior = i if i < lost else i + 1  # the survivors, rank N/2's holder gone
            return Claim(prior=prior, survivor=True, identity=_ident(prior), members=last, digest=digest)

        store.multi_set([keys.rank_claim(i) for i in range(1, n)],  # type: ignore[attr-defined]
                        [claim(i).to_json() for i in range(1, n)])
        store.check([keys.rank_claim(n - 1)])  # a reply: the server has stored every claim (set has none)
        t0 = time.perf_counter()
        zero = exchange_round(store, 0, n, claim(0))
        t1 = time.perf_counter()
        member = exchange_round(store, n - 1, n, claim(n - 1))
        t2 = time.perf_counter()
        out[name] = {"rank0_s": round(t1 - t0, 4), "member_s": round(t2 - t1, 4),
                     # the first round: any two distinct ranks; a lost node's: the survivor keeps its rank,
                     # the spare holds the lost one's
                     "ok": (zero.rank, member.rank) == (0, lost) if name == "lost"
                     else zero.rank != member.rank and {zero.rank, member.rank} <= set(range(n))}
    return out
