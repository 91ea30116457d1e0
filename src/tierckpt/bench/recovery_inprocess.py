"""``tierckpt bench recovery --compile``: a ``torch.compile``d job's recovery, in-process against
warm, cold and torchrun, for a NaN, a hang and a SIGKILL.

    tierckpt bench recovery --compile [--rounds 1] [--scenarios nan,hang,kill]
                            [--launchers inprocess,warm,cold,torchrun] [--step-time 0.1]
                            [--fault-step 10] [--cap 120] [--logs DIR] [--json PATH]

The job is ``tierckpt.demo.resilient --compile`` (its MLP compiled once per process) under
two agents x one worker (``twonode``); the standbys of ``inprocess`` and ``warm`` import
``WARM_IMPORTS`` ahead (``--warm-imports``), as a compiled job's should. Launchers: ``inprocess`` (``tierckpt run``, the loop
under ``tierckpt.resilient``), ``warm``, ``cold`` (``--no-warm``) and ``torchrun``. Faults on
rank 1: ``nan`` (a non-finite loss at ``--fault-step``; under torchrun the job exits on it,
what a torchrun job does), ``hang`` (rank 1 blocks forever, rank 0 in its all-reduce;
torchrun has no hang detection: capped at ``--cap``), ``kill`` (SIGKILL of the worker; under
the in-process job the survivor stays in-process and one replacement, a warm standby, joins it:
launcher/inprocess/replace.py). The figure: the fault (traced by the job, or the kill) until both ranks
finished their first step after the restore. Stages (each
ends when the slower rank reaches it): detect (-> the launcher's fault event, or the rank that
saw it first), stop (-> the ranks left the step: processes stopped and restarted, or the
in-process barrier), process group (-> ``pg`` traced), load (-> state restored), first step
(-> both ranks stepped; ``recompile``: the first forward's share of it, where a new process
compiles). A replacement's own stages (``REPLACEMENT``, from its trace): spawn (the kill -> its
script runs), imports, join (-> its process group of the next in-process generation), load,
compile (its first forward, from the on-disk inductor caches). Goals: NaN and hang <= 0.1 x torchrun, SIGKILL <= 0.3 x torchrun (a torchrun hang
not recovered in ``--cap`` counts as ``--cap``: the ratio is then an upper bound).
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

from tierckpt.bench.harness.recovery_job import RecoveryJob, scratch, torch_version
from tierckpt.testing.twonode import RANKS, JobTimeout

__all__ = ["main"]

SCENARIOS = ("nan", "hang", "kill")
LAUNCHERS = ("inprocess", "warm", "cold", "torchrun")
STAGES = ("detect", "stop", "pg", "load", "first_step")
REPLACEMENT = ("spawn", "imports", "join", "load", "compile")
#: what a compiled job's standbys import ahead (``--warm-imports``): inductor's compiler, 3.6 s to
#: import on the shared machine, else paid by a replacement's ``torch.compile`` and first forward
WARM_IMPORTS = ("torch._inductor.compile_fx",)
_GOALS = {"nan": 0.1, "hang": 0.1, "kill": 0.3}
_START_S = 300.0
_SHORT = {"inprocess": "ip", "warm": "warm", "cold": "cold", "torchrun": "tr"}


class _CompiledJob(RecoveryJob):
    """The recovery job with ``--compile``, the in-process wrapper and the scenario's fault."""

    def __init__(self, mode: str, scenario: str, root: Path, shm: Path, *, fault_step: int, step_time: float) -> None:
        super().__init__("warm" if mode == "inprocess" else mode, root, shm,
                         steps=fault_step + int(300 / step_time), step_time=step_time)
        self.label, self.scenario, self.fault_step = mode, scenario, fault_step

    def command(self, node: int) -> list[str]:
        cmd = super().command(node)
        if self.label in ("inprocess", "warm"):  # [python, -m, tierckpt.cli, run, ...]: a compiled job's standbys
            cmd = [*cmd[:4], f"--warm-imports={','.join(WARM_IMPORTS)}", *cmd[4:]]
        extra = ["--compile"] + (["--inprocess"] if self.label == "inprocess" else [])
        if self.scenario == "nan":
            extra += ["--fault", "exit" if self.label == "torchrun" else "nan", "--fault-step", str(self.fault_step)]
        elif self.scenario == "hang":
            extra += ["--fault", "hang", "--fault-step", str(self.fault_step)]
        return [*cmd, *extra]

    def env(self, node: int) -> dict[str, str]:
        return {**super().env(node), "TORCHINDUCTOR_CACHE_DIR": str(self.root.parent / "inductor-cache")}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierckpt bench recovery --compile",
                                description="A compiled job's recovery: in-process, warm, cold, torchrun.")
    p.add_argument("--compile", action="store_true", help="(this suite)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--launchers", default=",".join(LAUNCHERS))
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--fault-step", type=int, default=10)
    p.add_argument("--cap", type=float, default=120.0, help="seconds to wait for a recovery (default 120)")
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--logs", metavar="DIR")
    p.add_argument("--json", metavar="PATH")
    return p


def _subset(p: argparse.ArgumentParser, text: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    asked = {x.strip() for x in text.split(",") if x.strip()}
    if not asked or asked - set(allowed):
        p.error(f"{flag}: choose from {', '.join(allowed)} (got {text!r})")
    return tuple(x for x in allowed if x in asked)


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    scenarios = _subset(p, args.scenarios, SCENARIOS, "--scenarios")
    launchers = _subset(p, args.launchers, LAUNCHERS, "--launchers")
    if args.rounds < 1 or args.fault_step < 2 or args.step_time <= 0 or args.cap <= 0:
        p.error("--rounds must be >= 1, --fault-step >= 2, --step-time and --cap positive")
    load_start = os.getloadavg()
    runs: list[dict[str, Any]] = []
    with scratch(args.shm_dir, args.logs) as (logs, shm):
        for rnd in range(args.rounds):
            for scenario in scenarios:
                for mode in launchers:
                    # short names: a hosted node agent's Unix socket lives under the memory dir (108 bytes)
                    job = _CompiledJob(mode, scenario, logs / f"r{rnd}-{scenario}-{_SHORT[mode]}", shm,
                                       fault_step=args.fault_step, step_time=args.step_time)
                    runs.append({"round": rnd, "scenario": scenario, "launcher": mode, **_run_one(job, args)})
                    r = runs[-1]
                    print(f"  round {rnd + 1}: {scenario:<4} {mode:<9} "
                          f"{_fmt(r.get('value_s')) if not r.get('error') else 'FAILED: ' + r['error']}", flush=True)
    doc = _summarise(runs, scenarios, launchers, args)
    doc["env"] = {"cpus": os.cpu_count(), "load_average_start": list(load_start),
                  "load_average_end": list(os.getloadavg()), "torch": torch_version(),
                  "python": sys.version.split()[0]}
    print(format_report(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if any(r.get("error") for r in runs) else 0


def _run_one(job: _CompiledJob, args: argparse.Namespace) -> dict[str, Any]:
    try:
        job.start()
        job.wait_for(lambda: job.min_step() >= args.fault_step - 1 or (job.exited() and "exited"), _START_S,
                     f"both ranks to reach step {args.fault_step - 1}")
        if job.exited():
            raise JobTimeout(f"{job.label}: an agent exited early; logs in {job.root}")
        if job.scenario == "kill":
            if job.label in ("warm", "inprocess"):
                job.wait_for(lambda: job.standbys_ready() or (job.exited() and "exited"), _START_S, "ready standbys")
            job.wait_for(lambda: job.min_step() >= args.fault_step, _START_S, "the fault step")
            victim_rank, pid = job.victim(node=1)
            t_fault = time.time()
            os.kill(pid, signal.SIGKILL)
        else:
            fault = job.wait_for(lambda: [e for e in job.trace(1) if e["event"] == "fault"], _START_S, "the fault")
            t_fault = float(fault[0]["time"])
        try:
            firsts = job.wait_for(lambda: _first_steps(job, t_fault), args.cap, "both ranks to step again")
        except JobTimeout:
            return {"value_s": None, "capped_s": args.cap}
        out = {"value_s": max(e["time"] for e in firsts.values()) - t_fault, **_stages(job, t_fault, firsts)}
        if job.scenario == "kill" and job.label == "inprocess":
            out["replacement_s"] = _replacement(job, victim_rank, pid, t_fault)
        return out
    except JobTimeout as exc:
        return {"value_s": None, "error": str(exc)}
    finally:
        job.close()


def _first_steps(job: _CompiledJob, t_fault: float) -> dict[int, dict[str, Any]] | None:
    """Per rank, the first step traced after a ``resumed`` later than the fault."""
    out = {}
    for r in RANKS:
        tr = job.trace(r)
        back = next((i for i, e in enumerate(tr) if e["event"] == "resumed" and e["time"] > t_fault), None)
        step = None if back is None else next((e for e in tr[back:] if e["event"] == "step"), None)
        if step is None:
            return None
        out[r] = step
    return out


def _replacement(job: _CompiledJob, rank: int, dead: int, t_fault: float) -> dict[str, float | None]:
    """The replacement process's own stages (its trace: start, imported, pg, resumed, first step)."""
    tr = [e for e in job.trace(rank) if e["pid"] != dead and e["time"] > t_fault]
    marks = [next((float(e["time"]) for e in tr if e["event"] == ev), None)
             for ev in ("start", "imported", "pg", "resumed")]
    first = next((e for e in tr if e["event"] == "step"), None)
    out: dict[str, float | None] = {}
    prev: float | None = t_fault
    for name, mark in zip(REPLACEMENT[:4], marks, strict=True):
        out[name] = None if mark is None or prev is None else max(0.0, mark - prev)
        prev = mark
    out["compile"] = None if first is None else float(first.get("forward_s", 0.0))
    return out


def _stages(job: _CompiledJob, t_fault: float, firsts: dict[int, dict[str, Any]]) -> dict[str, Any]:
    def last(event: str) -> float | None:
        found = [next((e for e in job.trace(r) if e["event"] == event and e["time"] > t_fault), None) for r in RANKS]
        return None if any(f is None for f in found) else max(float(f["time"]) for f in found if f)

    pg_events = [next((e for e in job.trace(r) if e["event"] == "pg" and e["time"] > t_fault), {}) for r in RANKS]
    seen = [float(e["fault_time"]) for e in pg_events if e.get("fault_time")]
    faults = [e["time"] for e in job.events("fault") if e["time"] >= t_fault - 1]
    detect = min(seen) if seen and job.label == "inprocess" and job.scenario != "kill" else \
        (min(faults) if faults else None)
    stopped = [e["time"] for e in job.events("stopped") if e["time"] >= t_fault - 1]
    pg = last("pg")
    stop = max(stopped) if stopped else None
    if job.label == "inprocess" and pg is not None and not stopped:  # the barrier ended just before init
        stop = pg - max(float(e.get("stages_s", {}).get("pg", 0.0)) for e in pg_events)
    marks = [t_fault, detect, stop, pg, last("resumed"), max(e["time"] for e in firsts.values())]
    stages: dict[str, float | None] = {}
    prev = t_fault
    for name, mark in zip(STAGES, marks[1:], strict=True):
        stages[name] = None if mark is None else max(0.0, mark - prev)
        prev = mark if mark is not None else prev
    return {"stages_s": stages, "recompile_s": max(float(e.get("forward_s", 0.0)) for e in firsts.values()),
            "resumed_step": [e["step"] - 1 for e in firsts.values()]}


def _summarise(runs: list[dict[str, Any]], scenarios: tuple[str, ...], launchers: tuple[str, ...],
               args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    goals = []
    for sc in scenarios:
        fig: dict[str, Any] = {}
        for mode in launchers:
            mine = [r for r in runs if r["scenario"] == sc and r["launcher"] == mode]
            vals = [float(r["value_s"] if r["value_s"] is not None else r["capped_s"]) for r in mine
                    if r["value_s"] is not None or r.get("capped_s") is not None]
            capped = any(r.get("capped_s") for r in mine)
            stages = [r["stages_s"] for r in mine if "stages_s" in r]
            fig[mode] = {"median_s": statistics.median(vals) if vals else None, "capped": capped,
                         "runs_s": [r["value_s"] for r in mine],
                         "recompile_s": statistics.median(r["recompile_s"] for r in mine if "recompile_s" in r)
                         if any("recompile_s" in r for r in mine) else None,
                         "stages_s": {s: statistics.median(x[s] for x in stages if x[s] is not None)
                                      if any(x[s] is not None for x in stages) else None for s in STAGES}}
            reps = [r["replacement_s"] for r in mine if "replacement_s" in r]
            if reps:
                fig[mode]["replacement_s"] = {s: statistics.median(x[s] for x in reps if x[s] is not None)
                                              if any(x[s] is not None for x in reps) else None for s in REPLACEMENT}
        figures[sc] = fig
        tr, ip = fig.get("torchrun", {}), fig.get("inprocess", {})
        if tr.get("median_s") and ip.get("median_s") is not None and not ip.get("capped"):
            ratio = ip["median_s"] / tr["median_s"]
            bound = " (torchrun capped: an upper bound)" if tr.get("capped") else ""
            goals.append({"name": f"{sc}: in-process <= {_GOALS[sc]} x torchrun{bound}", "value": ratio,
                          "pass": ratio <= _GOALS[sc]})
        else:
            goals.append({"name": f"{sc}: in-process <= {_GOALS[sc]} x torchrun", "value": None, "pass": None})
    return {"tool": "tierckpt bench (recovery --compile)", "figures": figures, "goals": goals, "runs": runs,
            "config": {"rounds": args.rounds, "step_time_s": args.step_time, "fault_step": args.fault_step,
                       "cap_s": args.cap, "scenarios": list(scenarios), "launchers": list(launchers)}}


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f} s"


def format_report(doc: dict[str, Any]) -> str:
    cfg, figs, env = doc["config"], doc["figures"], doc["env"]
    cols = cfg["launchers"]
    w = 11
    lines = [f"\ntierckpt bench recovery --compile: 2 agents x 1 worker, gloo on 127.0.0.1, a torch.compile'd MLP, "
             f"step {cfg['step_time_s']:g} s, fault at step {cfg['fault_step']}, {cfg['rounds']} round(s); medians",
             f"load average {env['load_average_start'][0]:.1f} at start, {env['load_average_end'][0]:.1f} at end "
             f"on {env['cpus']} CPUs",
             f"  {'':<34}" + "".join(f"{c:>{w}}" for c in cols)]
    rows = {"nan": "NaN loss -> both ranks step again", "hang": "hang -> both ranks step again",
            "kill": "SIGKILL -> both ranks step again"}
    for sc, fig in figs.items():
        cells = []
        for c in cols:
            f = fig[c]
            cells.append(f">{cfg['cap_s']:g} s" if f["capped"] else _fmt(f["median_s"]))
        lines.append(f"  {rows[sc]:<34}" + "".join(f"{x:>{w}}" for x in cells))
        for s in STAGES:
            lines.append(f"  {'    ' + s:<34}" + "".join(f"{_fmt(fig[c]['stages_s'][s]):>{w}}" for c in cols))
        lines.append(f"  {'      of which recompile (1st fwd)':<34}" +
                     "".join(f"{_fmt(fig[c]['recompile_s']):>{w}}" for c in cols))
        if any("replacement_s" in fig[c] for c in cols):
            for s in REPLACEMENT:
                lines.append(f"  {'    replacement: ' + s:<34}" + "".join(
                    f"{_fmt(fig[c].get('replacement_s', {}).get(s)):>{w}}" for c in cols))
    lines.append("goals")
    for g in doc["goals"]:
        verdict = "n/a " if g["pass"] is None else ("PASS" if g["pass"] else "MISS")
        lines.append(f"  {verdict}  {g['name']}: {'n/a' if g['value'] is None else format(g['value'], '.3f')}")
    for r in doc["runs"]:
        if r.get("error"):
            lines.append(f"  FAILED {r['scenario']} {r['launcher']} round {r['round'] + 1}: {r['error']}")
    return "\n".join(lines)
