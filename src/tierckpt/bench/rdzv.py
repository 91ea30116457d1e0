"""``tierckpt bench rdzv``: ``--rdzv-backend tierckpt`` (membership/rdzv.py) at N simulated nodes, torch's c10d beside it.

Per N, on one TCPStore hosted by its own process (scale.StoreHost: the libuv server, the one a
job's store is, or the legacy one with ``--legacy-store``), ``--procs`` processes of simulated
agents (rdzv_sim.py) hold N + 1 real handlers, min = max = N; agent N is a spare:

1. first rendezvous: agents 0..N-1 call ``next_rendezvous`` at once and, up to ``--claims-max``
   nodes, exchange their rank claims (membership/ranks.py, as the agent does) → from the last
   arrival (its ``add``) until every agent returned, and until every agent has its group rank; the
   ranks must be a permutation of 0..N-1;
2. steady state: every member polls ``num_nodes_waiting`` once per ``--interval`` for
   ``--window`` s, at max_nodes, then as an elastic job below its max → store operations per node
   per interval, the store's CPU;
3. lost node: the member that holds rank N/2 is gone; the N-1 others and the spare call
   ``next_rendezvous`` (the next round) and exchange their rank claims (the survivors name the
   membership they knew by digest) → from then until every node returned
   (re-formed) and has its group rank (the survivors keep theirs, the spare holds the lost one's);
4. the rank exchange alone (rdzv_alone.py, up to ``--claims-max``): torch rank 0's and one
   member's ``exchange_round`` timed with the simulator idle, both rounds;
5. torch, N ≤ ``--torch-max``: scale.py's c10d phases (first rendezvous from the start of the
   calls; a lost node's re-rendezvous, min N-1, max N, no spare), capped at ``--rdzv-cap``.

The resolver gives up a lost DNS query after 1 s (``scale.quick_resolver``: torch's sockets look up
both ends' names on every connect). Every phase reports the store's CPU and the simulator's (all its processes), in cores.
Call order: ``main(argv)`` → ``run_n`` per N → ``table`` and ``goals``; ``--plot`` last.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from tierckpt.bench.rdzv_alone import exchange_alone
from tierckpt.bench.scale import Sims, StoreHost, cpu_seconds, plot_lines, run_unwinding

__all__ = ["GOALS", "goals", "main", "run_n", "series", "table"]

GOALS = {64: (0.3, 0.5), 1024: (2.0, 1.5), 4096: (6.0, 4.0)}  # N: (first rendezvous, lost node → re-formed), s


def _phase(sims: Sims, host: StoreHost, msgs: list[Any], timeout: float) -> tuple[list[Any] | None, dict[str, float]]:
    """One message to each simulation process; their replies and the phase's wall time and CPU."""
    pids = [p.pid for p in sims.procs if p.pid is not None]
    h0, s0, t0 = host.cpu(), sum(cpu_seconds(p) for p in pids), time.monotonic()
    got = sims.ask(msgs, timeout)
    wall = time.monotonic() - t0
    cost = {"wall_s": wall, "store_cpu": (host.cpu() - h0) / wall,
            "sim_cpu": (sum(cpu_seconds(p) for p in pids) - s0) / wall}
    return got, cost


def _round(sims: Sims, host: StoreHost, shares: list[list[int]], claims: bool,
           timeout: float) -> tuple[float, list[Any] | None, dict[str, float]]:
    """A round: every process parks a thread per agent (rdzv_sim.py), then all go at one moment
    ``at`` (wall clock, 0.1 s ahead); (at, the replies, the round's wall time and CPU from ``at``)."""
    ready = sims.ask([("round", share, claims) for share in shares], timeout)
    if ready is None:
        return time.time(), None, {}
    at = time.time() + 0.1
    got, cost = _phase(sims, host, [("go", at)] * len(shares), timeout)
    return at, got, cost


def _done(got: list[dict[str, Any]]) -> tuple[list[tuple[Any, ...]], dict[str, int]]:
    done: list[tuple[Any, ...]] = []
    failed: dict[str, int] = {}
    for x in got:
        done.extend(x["done"])
        for why, k in x["failed"].items():
            failed[why] = failed.get(why, 0) + k
    return done, failed


def run_n(n: int, a: argparse.Namespace) -> dict[str, Any]:
    """Phases 1-3 at N nodes; every figure in one dict (a phase that failed says why)."""
    settings = {"store_timeout_s": a.join_timeout + 60, "join_timeout_s": a.join_timeout, "poll_s": a.poll,
                "sim": a.sim}
    out: dict[str, Any] = {}
    limit = a.join_timeout + 60
    with StoreHost(a.libuv) as host, Sims(host.port, n + 1, a.procs, serve=_serve()) as sims:
        spare = n
        got, cost = _phase(sims, host, [("connect", share, n, settings) for share in sims.shares], 600)
        if got is None:
            raise TimeoutError(f"{n + 1} simulated agents did not connect within 600 s")
        out["connect_s"] = cost["wall_s"]
        # 1. first rendezvous
        claims = n <= a.claims_max
        _, got, cost = _round(sims, host, [[i for i in s if i != spare] for s in sims.shares], claims, limit)
        if got is None:
            out["error"] = f"the first rendezvous did not end within {limit:g} s"
            return out
        done, failed = _done(got)
        first = {i: group for i, _, _, _, _, group, _ in done}  # the exchange's rank (the handler's without claims)
        last_arrival = max(t for _, t, *_ in done)
        out["first"] = {"s": max(r for _, _, r, *_ in done) - last_arrival,
                        "spread_s": last_arrival - min(t for _, t, *_ in done),
                        "ranks_ok": sorted(first.values()) == list(range(n)) and {w for *_, w, _, _ in done} == {n},
                        "failed": failed, **cost}
        if claims:
            out["first"]["ranked_s"] = max(t for *_, t in done) - last_arrival
        # 2. steady state
        for name, below in (("steady_at_max", False), ("steady_below_max", True)):
            got, cost = _phase(sims, host, [("steady", a.interval, a.window, below)] * len(sims.shares), a.window + 60)
            if got is None:
                out["error"] = f"{name} did not end within {a.window + 60:g} s"
                return out
            polls = sum(x["polls"] for x in got)
            out[name] = {"ops_per_node_interval": sum(x["ops"] for x in got) / max(polls, 1),
                         "intervals": min(x["ticks"] for x in got), "nominal": round(a.window / a.interval), **cost}
        # 3. lost node: rank N/2's agent is gone; the others and the spare form the next round
        victim = next(i for i, r in first.items() if r == n // 2)
        t_lost, got, cost = _round(sims, host, [[i for i in s if i != victim] for s in sims.shares], claims, limit)
        if got is None:
            out["error"] = f"the lost node's round did not end within {limit:g} s"
            return out
        done, failed = _done(got)
        group = {i: g for i, _, _, _, _, g, _ in done}
        lost = {"reformed_s": max(r for _, _, r, *_ in done) - t_lost,
                "arrived_s": max(t for _, t, *_ in done) - t_lost,  # the simulator's start of 4096 calls
                "handler_ranks_ok": sorted(r for *_, r, _, _, _ in done) == list(range(n)),
                "failed": failed, **cost}
        if claims:
            lost["ranked_s"] = max(t for *_, t in done) - t_lost
            lost["spare_holds_lost_rank"] = group.get(spare) == n // 2 and all(
                group.get(i) == r for i, r in first.items() if i != victim)
        out["lost"] = lost
        if claims:  # 4. the exchange's own cost, the simulator idle (rdzv_alone.py)
            out["alone"] = exchange_alone(host.port, n)
    return out


def _serve() -> Any:
    from tierckpt.bench.rdzv_sim import serve

    return serve


def _fmt(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.3f} s" if unit == "s" else f"{100 * v:.0f} %"


def table(rows: dict[int, dict[str, Any]], cap: float) -> str:
    head = ("N", "first rdzv", "→ ranks", "arrivals spread", "store CPU", "sim CPU", "ops/node/interval at max",
            "below max", "steady store CPU", "lost → re-formed", "→ ranks (spare holds lost)", "store CPU",
            "sim CPU", "torch first rdzv", "torch re-rdzv")
    lines = [" | ".join(head)]
    for n, r in rows.items():
        o, t = r["ours"], r["torch"]
        f, lo = o.get("first", {}), o.get("lost", {})
        at, below = o.get("steady_at_max", {}), o.get("steady_below_max", {})
        ranked = "not run" if "ranked_s" not in lo else \
            f"{_fmt(lo['ranked_s'])} ({'yes' if lo.get('spare_holds_lost_rank') else 'NO'})"
        torch_cells = ("not run", "not run") if not t else tuple(
            _fmt(t.get(k)) if t.get(k) is not None else f"> {cap:g} s" for k in ("first_rdzv_s", "rerdzv_s"))
        if t and t.get("first_rdzv_s") is None:
            torch_cells = (torch_cells[0], "not reached")
        lines.append(" | ".join((
            str(n), _fmt(f.get("s")) + ("" if f.get("ranks_ok", True) else " (ranks NOT a permutation)"),
            _fmt(f.get("ranked_s")), _fmt(f.get("spread_s")), _fmt(f.get("store_cpu"), "%"), _fmt(f.get("sim_cpu"), "%"),
            f"{at.get('ops_per_node_interval', float('nan')):.2f}", f"{below.get('ops_per_node_interval', float('nan')):.2f}",
            _fmt(below.get("store_cpu"), "%"), _fmt(lo.get("reformed_s")), ranked,
            _fmt(lo.get("store_cpu"), "%"), _fmt(lo.get("sim_cpu"), "%"), *torch_cells)))
    return "\n".join(lines)


def goals(rows: dict[int, dict[str, Any]]) -> list[str]:
    out = []
    for n, (first_goal, lost_goal) in GOALS.items():
        o = rows.get(n, {}).get("ours")
        if o is None:
            out.append(f"N/A   {n} nodes: not run")
            continue
        first, lo = o.get("first", {}), o.get("lost", {})
        took = lo.get("ranked_s", lo.get("reformed_s"))
        first_s = first.get("ranked_s", first.get("s"))
        ok1 = first_s is not None and first_s <= first_goal and first.get("ranks_ok") and not first["failed"]
        ok2 = took is not None and took <= lost_goal and lo.get("spare_holds_lost_rank", True) and not lo["failed"]
        what = "ranks assigned, spare holds the lost rank" if "ranked_s" in lo else "re-formed (no rank claims)"
        what1 = "every rank assigned" if "ranked_s" in first else "returned (no rank claims)"
        out.append(f"{'PASS' if ok1 else 'MISS'}  {n} nodes: first rendezvous, {what1} ≤ {first_goal:g} s ({_fmt(first_s)})")
        out.append(f"{'PASS' if ok2 else 'MISS'}  {n} nodes: lost node → {what} ≤ {lost_goal:g} s ({_fmt(took)})")
    per = {n: r["ours"].get("steady_below_max", {}).get("ops_per_node_interval") for n, r in rows.items()}
    vals = [v for v in per.values() if v is not None]
    flat = bool(vals) and max(vals) <= 1.5 * max(min(vals), 1e-9) and max(vals) <= 2.0
    out.append(f"{'PASS' if flat else 'MISS'}  steady state O(1): store operations per node per interval below max ("
               + ", ".join(f"{n}: {v:.2f}" if v is not None else f"{n}: -" for n, v in per.items()) + ")")
    return out


def series(rows: dict[int, dict[str, Any]], cap: float) -> dict[str, list[float | None]]:
    """The plotted lines, one value per N in ``rows``' order; torch's unfinished phases at ``cap``."""
    ns = list(rows)
    out: dict[str, list[float | None]] = {
        "first rendezvous (tierckpt)": [rows[n]["ours"].get("first", {}).get("s") for n in ns],
        "lost node → re-formed with the spare (tierckpt)": [rows[n]["ours"].get("lost", {}).get("reformed_s") for n in ns],
    }
    first_ranked = [rows[n]["ours"].get("first", {}).get("ranked_s") for n in ns]
    if any(v is not None for v in first_ranked):
        out["first rendezvous, every rank assigned (tierckpt, rank claims)"] = first_ranked
    ranked = [rows[n]["ours"].get("lost", {}).get("ranked_s") for n in ns]
    if any(v is not None for v in ranked):
        out["lost node → every rank assigned, spare in the lost rank (tierckpt)"] = ranked
    if any(rows[n]["torch"] for n in ns):
        for key, label in (("first_rdzv_s", "first rendezvous"), ("rerdzv_s", "lost node → re-rendezvous")):
            out[f"{label} (torch c10d; {cap:g} s = did not finish)"] = [
                (rows[n]["torch"].get(key) or cap) if rows[n]["torch"] else None for n in ns]
    return out


def parser() -> argparse.ArgumentParser:
    """``tierckpt bench rdzv``'s options (``main`` parses with it)."""
    p = argparse.ArgumentParser(prog="tierckpt bench rdzv", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="64,256,1024,4096", help="simulated node counts, comma-separated")
    p.add_argument("--procs", type=int, default=4, help="simulation processes (the agents shared among them)")
    p.add_argument("--sim", choices=("greenlets", "threads"), default="greenlets",
                   help="simulated agents as greenlets on a pure-Python store client (the default: the "
                        "simulation costs less than the store), or threads on torch's client (as an agent runs it)")
    p.add_argument("--interval", type=float, default=0.1, help="the monitor's poll of num_nodes_waiting, s")
    p.add_argument("--window", type=float, default=3.0, help="steady-state window, s (each of the two)")
    p.add_argument("--poll", type=float, default=0.01, help="the round leader's poll, s (the handler's poll_s)")
    p.add_argument("--join-timeout", type=float, default=300.0, help="a round's limit, s")
    p.add_argument("--claims-max", type=int, default=4096,
                   help="exchange rank claims after each round up to this N (as the agent does)")
    p.add_argument("--torch-max", type=int, default=256, help="run torch's c10d phases up to this N")
    p.add_argument("--rdzv-cap", type=float, default=60.0, help="give each torch rendezvous this long, s")
    p.add_argument("--torch-conf", default="", help="torch handler settings, k=v,... (default: torchrun's)")
    p.add_argument("--libuv", dest="libuv", action="store_true", default=True,
                   help="the libuv store server (the default): torch's, and the job store's (c10d's create_backend)")
    p.add_argument("--legacy-store", dest="libuv", action="store_false",
                   help="torch's legacy store server (use_libuv=False: it poll()s every connection per event)")
    p.add_argument("--plot", metavar="PNG", help="plot the times per N (needs matplotlib)")
    return p


def main(argv: list[str]) -> int:
    return run_unwinding(_run, parser().parse_args(argv))


def _run(a: argparse.Namespace) -> int:
    from tierckpt.bench.scale import _torch

    ns = [int(x) for x in a.nodes.split(",") if x]
    load = os.getloadavg()
    print(f"bench rdzv: nodes {ns}, {'libuv' if a.libuv else 'legacy'} store server, {a.procs} processes of {a.sim}, monitor interval {a.interval:g} s; {os.cpu_count()} CPUs, "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}", flush=True)
    rows: dict[int, dict[str, Any]] = {}
    for n in ns:
        ours = run_n(n, a)
        print(f"  {n}: tierckpt {_rounded(ours)}", flush=True)
        theirs = _torch(n, a) if n <= a.torch_max else {}
        print(f"  {n}: torch {_rounded(theirs)}", flush=True)
        rows[n] = {"ours": ours, "torch": theirs}
    print()
    print(table(rows, a.rdzv_cap))
    print()
    print("\n".join(goals(rows)))
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    if a.plot and not plot_lines(ns, series(rows, a.rdzv_cap),
                                 "--rdzv-backend tierckpt: rendezvous time per cluster size", a.plot):
        return 1
    return 0


def _rounded(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _rounded(v) for k, v in d.items()}
    return round(d, 3) if isinstance(d, float) else d
