"""The non-finite-loss and lost-node scenarios of ``tierckpt bench recovery``.

Called by ``recovery._run_one`` once both ranks passed ``--fault-step`` (and, for ``warm``,
both agents hold a ready standby):

nan
    ``prepare_nan(job)`` before ``job.start()`` arms the demo's file trigger; ``nan(job)`` creates
    the file: rank 1 reports a NaN loss at its next step. ``tierckpt run`` sees it in the
    heartbeat (``NonFiniteLoss``) and restarts both ranks from the newest step *before* the NaN;
    torchrun cannot see a loss, so its job is the one a torchrun user writes: the script exits on
    a non-finite loss and torchrun restarts it. The figure: trigger -> both ranks train again;
    ``resumed_before_fault`` says whether the resumed step is older than the NaN step.
lostnode
    Agent 1 and every process under it are SIGKILLed at once and its memory tier wiped (the host
    is gone), then a replacement agent starts at once with an empty memory tier. ``tierckpt run``
    (replicas on by default for several nodes) restores node 1's shards from node 0's replica;
    torchrun has no copy of the lost node's memory, so once it stopped the survivor its tier is
    wiped too and the job starts over from step 0 (its replacement starts after that stop, which
    adds at most torchrun's own detection time to its figure). The figure: kill -> both ranks train again; ``resumed_step`` and
    ``step_before`` show the work lost.
"""

from __future__ import annotations

import time
from typing import Any

from tierckpt.testing.twonode import RANKS, TwoNodeJob

__all__ = ["describe", "lost_node", "nan", "prepare_nan"]

_RECOVER_S = 120.0


def prepare_nan(job: TwoNodeJob) -> None:
    """Arm the fault (before ``job.start()``): NaN under ``tierckpt run``, exit under torchrun."""
    kind = "exit" if job.launcher == "torchrun" else "nan"
    job.extra = ["--fault", kind, "--fault-file", str(job.root / "fault-now"), "--fault-generation", "0",
                 "--fault-rank", "1"]


def nan(job: TwoNodeJob) -> dict[str, Any]:
    old = job.pids()
    t_fault = time.time()
    (job.root / "fault-now").write_text("")
    first = job.wait_for(lambda: job.first_after("step", old), _RECOVER_S, "both ranks to train again")
    resumed = job.first_after("resumed", old) or {}
    faulted = [e["step"] for e in job.trace(1) if e["event"] == "step" and e.get("fault") and e["pid"] in old]
    # torchrun's script exits before it traces the faulty step: the step after the last one it traced
    fault_step = min(faulted) if faulted else 1 + max(e["step"] for e in job.trace(1)
                                                      if e["event"] == "step" and e["pid"] in old)
    steps = {r: resumed[r]["step"] for r in resumed}
    return {"value_s": max(e["time"] for e in first.values()) - t_fault, "fault_step": fault_step,
            "resumed_step": steps,
            "resumed_before_fault": bool(steps) and all(s is not None and s < fault_step for s in steps.values())}


def lost_node(job: TwoNodeJob) -> dict[str, Any]:
    old = job.pids()
    before = {r: max(e["step"] for e in job.trace(r) if e["event"] == "step") for r in RANKS}
    survivor = job.victim(node=0)[1]
    t_kill = job.lose_node(1)
    if job.launcher == "torchrun":  # no copy of node 1's memory anywhere: the job can only start over
        job.wait_for(lambda: not job.alive(survivor), _RECOVER_S, "torchrun to stop the survivor")
        job.wipe_memory(0)
    job.relaunch(1)
    first = job.wait_for(lambda: job.first_after("step", old), _RECOVER_S, "both ranks to train again")
    resumed = job.first_after("resumed", old) or {}
    return {"value_s": max(e["time"] for e in first.values()) - t_kill, "step_before": before,
            "resumed_step": {r: resumed[r]["step"] for r in resumed},
            "tiers": {r: resumed[r].get("tiers") for r in resumed}}


def describe(scenario: str, runs: list[dict[str, Any]]) -> str:
    """One report line: per launcher and run, the step resumed against the step of the fault."""
    parts = []
    for r in runs:
        if r.get("value_s") is None:
            parts.append(f"{r['launcher']} -")
            continue
        resumed = sorted({s for s in r["resumed_step"].values() if s is not None}) or ["none"]
        if scenario == "nan":
            parts.append(f"{r['launcher']} NaN at {r['fault_step']}, resumed {'/'.join(map(str, resumed))}")
        else:
            parts.append(f"{r['launcher']} at {max(r['step_before'].values())}, resumed "
                         f"{'/'.join(map(str, resumed))}")
    return ("steps: " if parts else "") + " | ".join(parts)
