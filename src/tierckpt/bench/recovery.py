"""``tierckpt bench recovery``: ``tierckpt run`` (warm and cold) against plain torchrun on every fault kind.

    tierckpt bench recovery [--rounds 3] [--scenarios crash,hang,nan,lostnode] [--step-time 0.1] [--fault-step 10]
                            [--hang-cap 30] [--shm-dir /dev/shm] [--logs DIR] [--json PATH]
    tierckpt bench recovery --compile ...     a compiled job, with in-process restarts (recovery_inprocess.py)

The same job (``tierckpt.demo.resilient``, a memory-tier checkpoint every step) runs under two
agents x one worker, gloo on 127.0.0.1 (see ``twonode``), once per launcher and scenario in
each round, the launcher order rotating between rounds. Launchers: ``warm`` (``tierckpt run``
as shipped: standby interpreters take over the ranks), ``cold`` (``tierckpt run --no-warm``)
and ``torchrun``.

crash (all three)
    SIGKILL of the worker under agent 1 once both ranks passed ``--fault-step`` (for ``warm``
    also once both agents report a ready standby: the steady state, faults being rarer than an
    import); the figure is the time until both ranks traced their first training step after
    the restore. For ``tierckpt run`` it is broken down by its events and the workers' traces
    (each stage ends when the slower node or rank reaches it, so they add up to the figure):
    detect (kill -> fault event), stop (-> both agents stopped their workers), restart (->
    restart events: the stop barrier, the generation's master port, spawn or hand-over),
    spawn (-> the new workers in ``main()``: a new interpreter importing the ``tierckpt``
    package, hence torch, or a standby taking over), imports (-> the script's own imports), process group (-> ``init_process_group``), load
    (-> state restored from memory), first step. For every launcher, kill -> both new workers
    in ``main()``.
nan, lostnode (warm and torchrun)
    A NaN loss on rank 1, and the loss of agent 1's whole host (memory tier included) with a
    replacement started at once: see ``recovery_faults``.
hang (warm and torchrun)
    SIGSTOP of that worker (for ``tierckpt run`` once its ``timeout`` event says the heartbeat
    timeout is calibrated); the figure is the time until a launcher reports it: the first
    ``fault`` event of ``tierckpt run``, for torchrun a new worker or an agent exiting. Waits are
    capped at ``--hang-cap`` seconds ("not detected").

Goals: crash recovery <= 0.5 x torchrun's cold and <= 0.3 x torchrun's warm (medians of this
run); hang detection <= max(3 x step interval, 10 s). Exit codes: 0 the run finished (verdicts
are in the report); 1 a figure that should exist is missing (a job did not start or recover);
2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tierckpt.bench import recovery_faults
from tierckpt.bench.harness.recovery_job import RecoveryJob, scratch, torch_version
from tierckpt.testing.twonode import RANKS, JobTimeout

__all__ = ["main"]

SCENARIOS = ("crash", "hang", "nan", "lostnode")
LAUNCHERS = ("warm", "cold", "torchrun")
# a standby does not change hang detection; nan and lostnode compare the default with torchrun
_RUNS = {"crash": LAUNCHERS, "hang": ("warm", "torchrun"), "nan": ("warm", "torchrun"),
         "lostnode": ("warm", "torchrun")}
STAGES = ("detect", "stop", "restart", "spawn", "imports", "pg", "load", "first_step")
_STAGE_LABELS = {"detect": "kill -> fault event (detection)", "stop": "-> workers stopped on both nodes",
                 "restart": "-> restart events (barrier, port, start)", "spawn": "-> in main() (cold: python, torch)",
                 "imports": "-> the script's imports done", "pg": "-> init_process_group done",
                 "load": "-> model built, state loaded from memory", "first_step": "-> first step on both ranks"}
_GOALS = {"cold": 0.5, "warm": 0.3}  # x torchrun (issue 7, issue 9)
_START_S, _RECOVER_S = 180.0, 120.0  # generous: the machine may be shared


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierckpt bench recovery",
                                description="Crash recovery and hang detection: tierckpt run (warm, cold) against "
                                "torchrun, one run.")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running every launcher once (default 3)")
    p.add_argument("--scenarios", default="crash,hang,nan,lostnode",
                   help="comma-separated subset of: crash, hang, nan, lostnode (default all)")
    p.add_argument("--step-time", type=float, default=0.1, help="seconds per training step (default 0.1)")
    p.add_argument("--fault-step", type=int, default=10, help="fault once both ranks passed this step (default 10)")
    p.add_argument("--hang-cap", type=float, default=30.0, help="seconds to wait for a hang to be reported (default 30)")
    p.add_argument("--shm-dir", default="/dev/shm", help="tmpfs for the nodes' memory tiers (removed at exit)")
    p.add_argument("--logs", metavar="DIR", help="keep the agents' logs, events and traces here (else removed)")
    p.add_argument("--json", metavar="PATH", help="also write every figure, run and verdict here")
    return p


def main(argv: list[str] | None = None) -> int:
    if "--compile" in (sys.argv[1:] if argv is None else argv):  # a compiled job: recovery_inprocess.py
        from tierckpt.bench.recovery_inprocess import main as compiled

        return compiled(argv)
    p = _parser()
    args = p.parse_args(argv)
    scenarios = tuple(s for s in SCENARIOS if s in {x.strip() for x in args.scenarios.split(",")})
    unknown = sorted({x.strip() for x in args.scenarios.split(",")} - set(SCENARIOS))
    if unknown or not scenarios:
        p.error(f"--scenarios: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(SCENARIOS)}")
    if args.rounds < 1 or args.fault_step < 1 or args.step_time <= 0 or args.hang_cap <= 0:
        p.error("--rounds and --fault-step must be at least 1; --step-time and --hang-cap must be positive")
    if not os.path.isdir(args.shm_dir):
        p.error(f"--shm-dir {args.shm_dir!r} is not a directory; point it at a tmpfs such as /dev/shm")
    runs: list[dict[str, Any]] = []
    load_start = os.getloadavg()
    with scratch(args.shm_dir, args.logs) as (logs, shm):
        for rnd in range(args.rounds):
            for scenario in scenarios:
                order = _RUNS[scenario][rnd % len(_RUNS[scenario]):] + _RUNS[scenario][:rnd % len(_RUNS[scenario])]
                for launcher in order:
                    job = RecoveryJob(launcher, logs / f"r{rnd}-{scenario}-{launcher}", shm,
                               steps=args.fault_step + int(240 / args.step_time), step_time=args.step_time)
                    runs.append({"round": rnd, "scenario": scenario, "launcher": launcher,
                                 **_run_one(job, scenario, args)})
                    print(_progress(runs[-1]), flush=True)
    doc = _summarise(runs, args, scenarios)
    doc.update(argv=list(sys.argv[1:] if argv is None else argv),
               env={"cpus": os.cpu_count(), "load_average_start": list(load_start),
                    "load_average_end": list(os.getloadavg()), "python": sys.version.split()[0],
                    "torch": torch_version()})
    print(format_report(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if doc["failures"] else 0


def _run_one(job: RecoveryJob, scenario: str, args: argparse.Namespace) -> dict[str, Any]:
    try:
        if scenario == "nan":
            recovery_faults.prepare_nan(job)
        job.start()
        job.wait_for(lambda: job.min_step() >= args.fault_step or (job.exited() and "exited"),
                     _START_S, f"both ranks to reach step {args.fault_step}")
        if job.exited():
            raise JobTimeout(f"{job.mode}: an agent exited before step {args.fault_step}; logs in {job.root}")
        if job.mode == "warm" and scenario != "hang":
            job.wait_for(lambda: job.standbys_ready() or (job.exited() and "exited"), _START_S,
                         "a ready standby on both agents")
        if scenario == "crash":
            return _crash(job)
        if scenario == "nan":
            return recovery_faults.nan(job)
        if scenario == "lostnode":
            return recovery_faults.lost_node(job)
        return _hang(job, args.hang_cap)
    except JobTimeout as exc:
        return {"value_s": None, "error": str(exc)}
    finally:
        job.close()


def _crash(job: RecoveryJob) -> dict[str, Any]:
    rank, pid = job.victim(node=1)
    old = job.pids()
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    first = job.wait_for(lambda: job.first_after("step", old), _RECOVER_S, "both ranks to train again")
    resumed = job.first_after("resumed", old) or {}
    t_first = max(e["time"] for e in first.values())
    out: dict[str, Any] = {"value_s": t_first - t_kill, "killed_rank": rank,
                           "resumed_step": {r: resumed[r]["step"] for r in resumed},
                           "step_before": {r: first[r]["step"] - 1 for r in RANKS}}
    starts = job.first_after("start", old)
    if starts:  # the launcher's share and the interpreter's: both new workers are in main()
        out["worker_start_s"] = max(e["time"] for e in starts.values()) - t_kill
        out["warm_ranks"] = sorted(r for r, e in starts.items() if e.get("warm"))
    if job.launcher == "tierckpt":
        out["stages_s"] = _stages(job, t_kill, old, t_first)
    return out


def _stages(job: RecoveryJob, t_kill: float, old: set[int], t_first: float) -> dict[str, float]:
    """The recovery split at each milestone's slowest node or rank; the stages add up to the total."""
    def latest(event: str) -> float:
        found = job.first_after(event, old) or {}
        return max(e["time"] for e in found.values())

    marks = [t_kill, min(e["time"] for e in job.events("fault") if e["time"] >= t_kill),
             max(e["time"] for e in job.events("stopped") if e["time"] >= t_kill),
             max(e["time"] for e in job.events("restart") if e["time"] >= t_kill and e.get("kind") == "process"),
             latest("start"), latest("imported"), latest("pg"), latest("resumed"), t_first]
    return {stage: marks[i + 1] - marks[i] for i, stage in enumerate(STAGES)}


def _hang(job: RecoveryJob, cap: float) -> dict[str, Any]:
    if job.launcher == "tierckpt":
        job.wait_for(lambda: len({e["node"] for e in job.events("timeout")}) == 2, 60,
                     "both agents to calibrate the heartbeat timeout")
    rank, pid = job.victim(node=1)
    old = job.pids()
    t_stop = time.time()
    os.kill(pid, signal.SIGSTOP)
    out: dict[str, Any] = {"stopped_rank": rank, "cap_s": cap}
    try:
        if job.launcher == "tierckpt":
            fault = job.wait_for(lambda: [e for e in job.events("fault") if e["time"] >= t_stop], cap, "a fault event")
            first = min(fault, key=lambda e: e["time"])
            timeout = [e["heartbeat_timeout_s"] for e in job.events("timeout")]
            out.update(value_s=first["time"] - t_stop, reason=first.get("reason"),
                       heartbeat_timeout_s=max(timeout))
        else:
            job.wait_for(lambda: job.exited() or job.first_after("start", old), cap, "torchrun to react")
            out.update(value_s=time.time() - t_stop, reason="agent exited" if job.exited() else "workers restarted")
    except JobTimeout:
        out.update(value_s=None, detected=False)
    return out


def _summarise(runs: list[dict[str, Any]], args: argparse.Namespace, scenarios: tuple[str, ...]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for scenario in scenarios:
        fig: dict[str, Any] = {}
        for launcher in _RUNS[scenario]:
            mine = [r for r in runs if r["scenario"] == scenario and r["launcher"] == launcher]
            values = [r["value_s"] for r in mine if r["value_s"] is not None]
            fig[launcher] = {"median_s": statistics.median(values) if values else None, "runs_s": [r["value_s"] for r in mine]}
            starts = [r["worker_start_s"] for r in mine if "worker_start_s" in r]
            if starts:
                fig[launcher]["worker_start_s"] = {"median_s": statistics.median(starts), "runs_s": starts}
            stages = [r["stages_s"] for r in mine if "stages_s" in r]
            if stages:
                fig[launcher]["stages_s"] = {s: {"median_s": statistics.median(x[s] for x in stages),
                                                 "runs_s": [x[s] for x in stages]} for s in STAGES}
        tr = fig["torchrun"]["median_s"]
        fig["ratio"] = {k: (fig[k]["median_s"] / tr if fig[k]["median_s"] is not None and tr else None)
                        for k in _RUNS[scenario] if k != "torchrun"}
        figures[scenario] = fig
    hang_goal = max(3 * args.step_time, 10.0)
    goals = []
    if "crash" in figures:
        for mode, target in _GOALS.items():
            ratio = figures["crash"]["ratio"][mode]
            goals.append({"name": f"crash recovery, {mode} <= {target} x torchrun", "target": target, "value": ratio,
                          "pass": None if ratio is None else ratio <= target})
    if "hang" in figures:
        med = figures["hang"]["warm"]["median_s"]
        goals.append({"name": f"hang detection <= max(3 x step, 10 s) = {hang_goal:g} s", "target": hang_goal,
                      "value": med, "pass": None if med is None else med <= hang_goal})
    if "nan" in figures:
        runs_nan = [r for r in runs if r["scenario"] == "nan" and r["launcher"] != "torchrun" and "fault_step" in r]
        ok = bool(runs_nan) and all(r["resumed_before_fault"] for r in runs_nan)
        goals.append({"name": "after a NaN, every rank resumes a step older than the NaN step", "target": 1,
                      "value": float(ok), "pass": ok if runs_nan else None})
    failures = [r for r in runs if r.get("error") or (r["value_s"] is None and (
        r["scenario"] != "hang" or r["launcher"] != "torchrun"))]
    return {"tool": "tierckpt bench (recovery)",
            "config": {"rounds": args.rounds, "scenarios": list(scenarios), "step_time_s": args.step_time,
                       "fault_step": args.fault_step, "hang_cap_s": args.hang_cap, "nodes": 2, "workers_per_node": 1},
            "figures": figures, "goals": goals, "runs": runs, "failures": failures}


def _fmt(v: float | None, cap: float | None = None) -> str:
    if v is None:
        return f"none in {cap:g} s" if cap is not None else "n/a"
    return f"{v:.2f} s"


def _progress(run: dict[str, Any]) -> str:
    cap = run.get("cap_s")
    what = _fmt(run["value_s"], cap) if not run.get("error") else f"FAILED: {run['error']}"
    return f"  round {run['round'] + 1}: {run['scenario']:<5} {run['launcher']:<8} {what}"


def format_report(doc: dict[str, Any]) -> str:
    cfg, figs = doc["config"], doc["figures"]
    w = 12
    lines = [f"\ntierckpt bench recovery: 2 agents x 1 worker, gloo on 127.0.0.1, step {cfg['step_time_s']:g} s, "
             f"fault after step {cfg['fault_step']}, {cfg['rounds']} round(s); medians (s), then each run",
             f"  {'':<46} {'tierckpt warm':>{w + 2}} {'tierckpt cold':>{w + 2}} {'torchrun':>{w + 2}}   x torchrun"]
    rows = {"crash": "crash: SIGKILL -> both ranks step again", "hang": "hang: SIGSTOP -> launcher reports it",
            "nan": "nan: NaN loss -> both ranks step again", "lostnode": "lost node: host gone -> both step again"}
    for scenario, fig in figs.items():
        cap = cfg["hang_cap_s"] if scenario == "hang" else None
        cols = [_fmt(fig[k]["median_s"], cap if k == "torchrun" else None) if k in fig else "-" for k in LAUNCHERS]
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in fig["ratio"].items() if v is not None) or "n/a"
        lines.append(f"  {rows[scenario]:<46} {cols[0]:>{w + 2}} {cols[1]:>{w + 2}} {cols[2]:>{w + 2}}   {ratios}")
        each = " | ".join(f"{k} " + " ".join("-" if v is None else f"{v:.2f}" for v in fig[k]["runs_s"])
                          for k in LAUNCHERS if k in fig)
        lines.append(f"    runs (s): {each}")
        if scenario in ("nan", "lostnode"):
            lines.append("    " + recovery_faults.describe(scenario, [r for r in doc["runs"] if r["scenario"] == scenario]))
        if any("worker_start_s" in fig.get(k, {}) for k in LAUNCHERS):
            ws = [_fmt(fig.get(k, {}).get("worker_start_s", {}).get("median_s")) for k in LAUNCHERS]
            lines.append(f"  {'    kill -> both new workers in main()':<46} {ws[0]:>{w + 2}} {ws[1]:>{w + 2}} "
                         f"{ws[2]:>{w + 2}}")
        if any("stages_s" in fig.get(k, {}) for k in ("warm", "cold")):
            lines.append(f"  {'    where tierckpt run spends it':<46}")
            for stage in STAGES:
                st = [_fmt(fig.get(k, {}).get("stages_s", {}).get(stage, {}).get("median_s")) for k in ("warm", "cold")]
                lines.append(f"  {'      ' + _STAGE_LABELS[stage]:<46} {st[0]:>{w + 2}} {st[1]:>{w + 2}}")
    lines.append("goals")
    for g in doc["goals"]:
        verdict = "n/a " if g["pass"] is None else ("PASS" if g["pass"] else "MISS")
        value = "n/a" if g["value"] is None else f"{g['value']:.2f}"
        lines.append(f"  {verdict}  {g['name']}: {value}")
    for f in doc["failures"]:
        lines.append(f"  FAILED {f['scenario']} {f['launcher']} round {f['round'] + 1}: {f.get('error', 'no figure')}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
