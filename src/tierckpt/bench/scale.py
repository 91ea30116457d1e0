"""``tierckpt bench scale``: the control plane at N simulated nodes, ours beside torch's c10d rendezvous.

Per N, on one TCPStore hosted by its own process (so its CPU can be read from /proc), with
``--procs`` processes of simulated agents (scale_sim.py):

1. ours, steady: every agent's Liveness for ``--window`` s → store operations per liveness
   interval per node (flat = O(N) in all), operations per second, the store host's CPU;
2. ours, fault: a claim of generation 0 → every agent saw it and stopped (fault → all stopped),
   and agreed on generation 1 through the stop barrier and the master key (restart agreement);
3. ours, lost node: one agent goes silent → the watcher's verdict → a LostNode claim → the
   survivors regroup (``JobControl.regroup``) and agree on the next master (re-rendezvous);
4. torch: DynamicRendezvousHandler (c10d backend, torchrun's settings unless ``--torch-conf``)
   for N nodes (min N-1, max N), then one handler stops its keep-alive and the others call
   next_rendezvous: its re-rendezvous. Either phase may overrun ``--rdzv-cap``: then "> cap".

Call order: ``main(argv)`` → ``run_n`` per N → ``table`` and ``goals``; ``--plot`` last.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from tierckpt.bench.scale_sim import BenchError

__all__ = ["Sims", "StoreHost", "cpu_seconds", "main", "plot_lines", "quick_resolver", "run_unwinding"]


def quick_resolver() -> None:
    """Give up a lost DNS query after 1 s (glibc's default: 5 s, then again) in this process and the
    ones it starts. torch's c10d sockets name both ends with a reverse lookup (getnameinfo) on every
    connect and in every timeout warning; ::ffff:127.0.0.1 is not in /etc/hosts, so each goes to the
    resolver, and the one here drops a few percent of them: a client took 5 s to connect every few
    dozen (4096 clients: ~15 minutes, the "slow accept" once put on the libuv server)."""
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

_SERVER = ("import ctypes, datetime, signal, sys, torch.distributed as d\n"
           "ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: goes with the bench, even a SIGKILLed one\n"
           "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, use_libuv={libuv},\n"
           "               timeout=datetime.timedelta(seconds=600))\n"
           "print(s.port, flush=True)\nsys.stdin.read()\n")


def cpu_seconds(pid: int) -> float:
    """Process ``pid``'s CPU seconds so far, user and system (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class StoreHost:
    """The TCPStore server in its own process; ``cpu()`` is its CPU seconds so far (/proc)."""

    def __init__(self, libuv: bool) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER.format(libuv=libuv)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout is None:
            raise BenchError("the simulator process has no stdout pipe")
        self.port = int(self.proc.stdout.readline())

    def __enter__(self) -> StoreHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def close(self) -> None:
        if self.proc.stdin is None or self.proc.stdout is None:
            raise BenchError("the simulator process has no pipes")
        self.proc.stdin.close()  # the server reads stdin to its end, then exits
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


class Sims:
    """``procs`` simulation processes, each holding an equal share of the N node ids; ``serve``
    is their loop (scale_sim.py's unless given: rdzv_sim.py's for ``bench rdzv``)."""

    def __init__(self, port: int, n: int, procs: int, serve: Any = None) -> None:
        if serve is None:
            from tierckpt.bench.scale_sim import serve

        ctx = mp.get_context("spawn")
        self.shares = [list(range(n))[k::procs] for k in range(min(procs, n))]
        self.pipes, self.procs = [], []
        self.lock = lock = ctx.Lock()  # kept: the children unpickle it after this returns
        for _ in self.shares:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=serve, args=(child, port, lock), daemon=True)
            p.start()
            self.pipes.append(parent)
            self.procs.append(p)

    def __enter__(self) -> Sims:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ask(self, msgs: list[Any], timeout: float) -> list[Any] | None:
        """Send one message to each process; their replies, or None past ``timeout``."""
        for pipe, msg in zip(self.pipes, msgs, strict=True):
            pipe.send(msg)
        deadline = time.monotonic() + timeout
        out = []
        for pipe in self.pipes:
            if not pipe.poll(max(0.0, deadline - time.monotonic())):
                return None
            out.append(pipe.recv())
        return out

    def all(self, msg: Any, timeout: float) -> list[Any] | None:
        return self.ask([msg] * len(self.pipes), timeout)

    def close(self) -> None:
        for pipe, p in zip(self.pipes, self.procs, strict=True):
            if p.is_alive():
                try:
                    pipe.send(("exit",))
                    if pipe.poll(5):
                        pipe.recv()
                except (BrokenPipeError, EOFError, OSError):
                    pass
            p.join(timeout=2)
            if p.is_alive():  # stuck in a rendezvous past the cap: ours to end, by pid
                p.kill()
                p.join()


def _ours(n: int, a: argparse.Namespace) -> dict[str, Any]:
    from tierckpt.launcher.control.jobcontrol import JobControl
    from tierckpt.launcher.control.store import connect_client

    settings = {"interval_s": a.interval, "node_timeout_s": a.node_timeout, "store_timeout_s": 600.0}
    out: dict[str, Any] = {}
    with StoreHost(a.libuv) as host, Sims(host.port, n, a.procs) as sims:
        if sims.ask([("ours", share, n, settings) for share in sims.shares], timeout=600) is None:
            raise TimeoutError(f"{n} simulated agents did not connect within 600 s")
        sims.all(("start",), 60)
        ctl = JobControl(connect_client("127.0.0.1", host.port))
        for pipe in sims.pipes:  # every agent's monitor loop follows generation 0's claim (claimwatch.py)
            pipe.send(("generation", 0, None))
        time.sleep(max(2 * a.interval, 1.0))  # every beat key exists; the watcher reads them with multi_get
        try:
            c0, cpu0, t0 = _counts(sims), host.cpu(), time.monotonic()
            time.sleep(a.window)
            c1, cpu1, t1 = _counts(sims), host.cpu(), time.monotonic()
        except TimeoutError as exc:
            out["error"] = f"{exc}; the claim of generation 0: {ctl.claimed(0)}"
            return out
        live = sum(x["live"] for x in c1) - sum(x["live"] for x in c0)
        ticks = sum(x["ticks"] for x in c1) - sum(x["ticks"] for x in c0)
        ops = live + sum(x["ctl"] for x in c1) - sum(x["ctl"] for x in c0)
        out.update(live_ops_per_interval_per_node=live / max(ticks, 1), ops_per_s=ops / (t1 - t0),
                   host_cpu=(cpu1 - cpu0) / (t1 - t0), watchers=sum(len(x["watching"]) for x in c1))
        t_claim = time.time()  # fault: a claim of generation 0
        ctl.claim(0, {"reason": "Crash", "node": 0, "time": t_claim})
        got, failed = _gather(sims, timeout=120)
        out["fault_agents_done"] = None if got is None else len(got)
        if failed:
            out["fault_failed"] = failed
        if got is not None and len(got) == n:
            out["fault_all_stopped_s"] = max(s for _, s, _ in got) - t_claim
            out["restart_agreement_s"] = max(d for _, _, d in got) - t_claim
        # lost node: a non-watcher goes silent; detection, claim and regroup happen in the agents
        victim = n // 2
        for pipe in sims.pipes:
            pipe.send(("generation", 1, victim))
        t_dead = time.time()
        got, failed = _gather(sims, timeout=a.node_timeout * 4 + 120)
        rec = ctl.claimed(1)
        out["lost_agents_done"] = None if got is None else len(got)
        if failed:
            out["lost_failed"] = failed
        out["lost_claim"] = None if rec is None else {k: rec.get(k) for k in ("reason", "node", "lost")}
        if got is not None and rec is not None and len(got) == n - 1:
            out["detect_s"] = float(rec["time"]) - t_dead
            out["rerdzv_s"] = max(d for _, _, d in got) - float(rec["time"])
    return out


def _counts(sims: Sims) -> list[dict[str, Any]]:
    """Every process's counters, read while its agents run (a generation answers later)."""
    got = sims.all(("count",), 60)
    if got is None:
        raise TimeoutError("a simulation process did not report its counters within 60 s")
    if not all(isinstance(x, dict) for x in got):
        raise TimeoutError("generation 0 ended before the bench's claim (an agent claimed a fault)")
    return got


def _gather(sims: Sims, timeout: float) -> tuple[list[tuple[int, float, float]] | None, dict[str, int]]:
    """Every process's answer to a generation: the agents that agreed on the next one, and why the
    others did not (counted by reason); ``None`` when a process did not answer within ``timeout``."""
    deadline = time.monotonic() + timeout
    out: list[tuple[int, float, float]] = []
    failed: dict[str, int] = {}
    for pipe in sims.pipes:
        if not pipe.poll(max(0.0, deadline - time.monotonic())):
            return None, failed
        got = pipe.recv()
        out.extend(got["done"])
        for why, count in got["failed"].items():
            failed[why] = failed.get(why, 0) + count
    return out, failed


def _torch(n: int, a: argparse.Namespace) -> dict[str, Any]:
    conf = dict(kv.split("=", 1) for kv in a.torch_conf.split(",") if "=" in kv)
    settings = {"store_timeout_s": 600.0, "torch_conf": conf}
    out: dict[str, Any] = {}
    with StoreHost(a.libuv) as host, Sims(host.port, n, a.procs) as sims:
        if sims.ask([("torch", share, n, settings) for share in sims.shares], timeout=600) is None:
            raise TimeoutError(f"{n} simulated torch agents did not connect within 600 s")
        t0 = time.time()
        first = sims.all(("first",), timeout=a.rdzv_cap)
        if first is None:
            out["first_rdzv_s"] = None
            return out
        out["first_rdzv_s"] = max(t for x in first for _, t, _ in x["done"]) - t0
        victim = n // 2
        sims.ask([("kill", victim)] * len(sims.pipes), timeout=30)
        cpu0, t0 = host.cpu(), time.time()
        again = sims.all(("again",), timeout=a.rdzv_cap)
        if again is None:
            out["rerdzv_s"] = None
            return out
        t1 = time.time()
        out["rerdzv_s"] = max(t for x in again for _, t, _ in x["done"]) - t0
        out["rerdzv_ops_per_s"] = sum(x["ops"] for x in again) / max(t1 - t0, 1e-9)
        out["host_cpu"] = (host.cpu() - cpu0) / max(t1 - t0, 1e-9)
        out["world"] = sorted({w for x in again for _, _, w in x["done"]})
    return out


def _fmt(v: float | None, cap: float | None = None, unit: str = "s") -> str:
    if v is None:
        return f"> {cap:g} {unit}" if cap is not None else "-"
    return f"{v:.3f} {unit}" if unit == "s" else f"{v:.2f}{unit}"


def table(rows: dict[int, dict[str, Any]], cap: float) -> str:
    head = ("N", "fault→stopped", "restart agree", "ops/interval/N", "all-to-all (prev)", "ops/s",
            "host CPU", "detect", "re-rdzv ours", "re-rdzv torch", "torch first rdzv", "torch host CPU")
    lines = [" | ".join(head)]
    for n, r in rows.items():
        o, t = r["ours"], r["torch"]
        lines.append(" | ".join((
            str(n), _fmt(o.get("fault_all_stopped_s")), _fmt(o.get("restart_agreement_s")),
            f"{o.get('live_ops_per_interval_per_node', 0):.2f}", f"{n:d}", f"{o.get('ops_per_s', 0):.0f}",
            f"{100 * o.get('host_cpu', 0):.0f} %", _fmt(o.get("detect_s")), _fmt(o.get("rerdzv_s")),
            _fmt(t.get("rerdzv_s"), cap) if "rerdzv_s" in t or t.get("first_rdzv_s") is not None else "not reached",
            _fmt(t.get("first_rdzv_s"), cap), f"{100 * t['host_cpu']:.0f} %" if "host_cpu" in t else "-")))
    return "\n".join(lines)


def goals(rows: dict[int, dict[str, Any]], cap: float) -> list[str]:
    out = []

    def line(ok: bool | None, what: str) -> None:
        out.append(f"{'PASS' if ok else 'MISS' if ok is not None else 'N/A '}  {what}")

    big = rows.get(1024)
    stop = big["ours"].get("fault_all_stopped_s") if big else None
    agree = big["ours"].get("restart_agreement_s") if big else None
    line(None if big is None else stop is not None and stop <= 1.0, f"1024 nodes: fault → all stopped ≤ 1 s ({_fmt(stop)})")
    line(None if big is None else agree is not None and agree <= 2.0, f"1024 nodes: restart agreement ≤ 2 s ({_fmt(agree)})")
    per = {n: r["ours"].get("live_ops_per_interval_per_node", 0.0) for n, r in rows.items()}
    flat = max(per.values()) <= 1.5 * min(per.values()) if per else None
    line(flat, "liveness traffic O(N): ops/interval/N flat across N (" +
         ", ".join(f"{n}: {v:.2f}" for n, v in per.items()) + ")")
    faster, said = [], []
    for n, r in rows.items():
        ours, theirs = r["ours"].get("rerdzv_s"), r["torch"].get("rerdzv_s")
        if theirs is not None:
            said.append(f"{n}: {_fmt(ours)} vs {_fmt(theirs)}")
        elif r["torch"].get("first_rdzv_s") is None and r["torch"]:
            said.append(f"{n}: {_fmt(ours)} vs torch's first rendezvous > {cap:g} s")
        else:
            said.append(f"{n}: {_fmt(ours)} vs > {cap:g} s" if r["torch"] else f"{n}: torch not run")
        bound = theirs if theirs is not None else cap  # torch did not finish: it took more than the cap
        faster.append(ours is not None and ours < bound and bool(r["torch"]))
    line(all(faster) if any(r["torch"] for r in rows.values()) else None,
         "re-rendezvous after a lost node: ours faster than torch's at every N (" + "; ".join(said) + ")")
    return out


def series(rows: dict[int, dict[str, Any]], cap: float) -> dict[str, list[float | None]]:
    """The plotted lines, one value per N in ``rows``' order; torch's unfinished rounds at ``cap``."""
    ns = list(rows)
    out: dict[str, list[float | None]] = {}
    for key, label in (("fault_all_stopped_s", "fault → all stopped"), ("restart_agreement_s", "restart agreement"),
                       ("rerdzv_s", "re-rendezvous (ours)")):
        out[label] = [rows[n]["ours"].get(key) for n in ns]
    if any(rows[n]["torch"] for n in ns):
        out[f"re-rendezvous (torch c10d; {cap:g} s = did not finish)"] = [
            (rows[n]["torch"].get("rerdzv_s") or cap) if rows[n]["torch"] else None for n in ns]
    return out


def _plot(rows: dict[int, dict[str, Any]], cap: float, path: str) -> bool:
    """Write the PNG at ``path``: seconds per simulated N, log-log; False without matplotlib."""
    return plot_lines(list(rows), series(rows, cap), "tierckpt control plane: recovery time per cluster size", path)


def plot_lines(ns: list[int], lines: dict[str, list[float | None]], title: str, path: str) -> bool:
    """Seconds per simulated N, log-log, one line per ``lines`` entry (None: no point; a label
    naming torch is drawn dashed); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install 'tierckpt[bench]' (or matplotlib)", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, ys in lines.items():
        torch_line = "torch" in label
        ax.plot(ns, [float("nan") if y is None else y for y in ys], marker="x" if torch_line else "o",
                linestyle="--" if torch_line else "-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("simulated nodes")
    ax.set_ylabel("seconds")
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"plot: {path}")
    return True


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tierckpt bench scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="64,256,1024", help="simulated node counts, comma-separated")
    p.add_argument("--procs", type=int, default=4, help="simulation processes (threads in each)")
    p.add_argument("--interval", type=float, default=0.5, help="liveness interval, s (tierckpt run's)")
    p.add_argument("--node-timeout", type=float, default=3.0, help="lost-node timeout, s")
    p.add_argument("--window", type=float, default=3.0, help="steady-state window, s")
    p.add_argument("--rdzv-cap", type=float, default=120.0, help="give torch's rendezvous this long, s")
    p.add_argument("--torch-conf", default="", help="torch handler settings, k=v,... (default: torchrun's)")
    p.add_argument("--no-torch", action="store_true", help="ours only")
    p.add_argument("--libuv", action="store_true",
                   help="libuv store server (torch's default; accepts a client every ~150 ms on some boxes)")
    p.add_argument("--plot", metavar="PNG", help="plot the times per N (needs matplotlib)")
    return run_unwinding(_run, p.parse_args(argv))


def run_unwinding(run: Callable[[argparse.Namespace], int], a: argparse.Namespace) -> int:
    """A bench's ``run(a)`` with the quick resolver, and SIGTERM/SIGHUP unwinding like Ctrl-C
    (``_exit_on``) while it runs; the previous handlers come back after it."""
    quick_resolver()
    before = {sig: signal.signal(sig, _exit_on) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return run(a)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _exit_on(signum: int, _frame: object) -> None:
    """SIGTERM/SIGHUP unwind like Ctrl-C: every ``with`` above closes its store and simulation
    processes (which also die with the bench by PDEATHSIG if it is SIGKILLed)."""
    raise SystemExit(128 + signum)


def _run(a: argparse.Namespace) -> int:
    ns = [int(x) for x in a.nodes.split(",") if x]
    print(f"bench scale: nodes {ns}, {a.procs} processes, liveness {a.interval:g} s, node timeout "
          f"{a.node_timeout:g} s; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} "
          f"{os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f}", flush=True)
    rows: dict[int, dict[str, Any]] = {}
    for n in ns:
        ours = _ours(n, a)
        print(f"  {n}: ours {({k: round(v, 3) if isinstance(v, float) else v for k, v in ours.items()})}",
              flush=True)
        theirs = {} if a.no_torch else _torch(n, a)
        print(f"  {n}: torch {theirs}", flush=True)
        rows[n] = {"ours": ours, "torch": theirs}
    print()
    print(table(rows, a.rdzv_cap))
    print()
    print("\n".join(goals(rows, a.rdzv_cap)))
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs "
          "(shared: timings are upper bounds)")
    if a.plot and not _plot(rows, a.rdzv_cap, a.plot):
        return 1
    return 0
