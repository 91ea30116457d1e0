"""The chaos soak: a seeded random schedule of faults, one after another, in one 2-node job.

2 agents x 1 worker of ``tierckpt.demo.resilient`` on 127.0.0.1 (an MLP trained with AdamW on
data that is a function of the step, a save every step), every launcher at the defaults a user
gets (``--node-timeout 10``) but ``--max-restarts``. A seeded schedule injects, each after 12-16
steps of healthy progress since the last recovery, every fault kind at least once:

- ``kill``: SIGKILL of a worker (under ``tierckpt.resilient``: the rank is replaced alone, the
  survivor keeps its process; without it: a process restart of both ranks);
- ``hang``: SIGSTOP of a worker (no beat, no exit: the launcher's hang detection);
- ``nan``: a real divergence (the rank makes its loss, gradients and update NaN: ``--inject-dir``);
- ``node``: node 1's machine is gone (its agent and workers, SIGSTOP then SIGKILL) and a new agent
  with an empty memory root takes its place. Node 0 hosts the rendezvous store: losing it ends
  the job (the rendezvous issue), so it is never the one lost.

Asserted: every launcher exits 0; each fault is reported once, with the reason of its kind and
the rank that was hit (a node loss: not yet: the survivor's own rank is blamed, a ``Crash`` or
``Hang`` of a collective whose peer is gone, until the diagnosis stage of issue 25; the soak
prints what was blamed); no restart beyond one per fault (a failed save that turns into
spurious in-process restarts fails here); no backoff (every fault follows healthy progress);
every resume loaded the exact state saved at its step
(digests); the final parameters and optimizer state equal a fault-free run's, bit for bit.
Printed: faults survived, steps redone, extra wall time against the fault-free run, and how much
of it was backoff, detection and recovery (performance is not asserted: benchmarks do that).

Seeds: ``TIERCKPT_SOAK_SEEDS`` (comma-separated; default one seed per mode in the slow tier).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.launcher.cluster import LocalJob
from tests.launcher.conftest import shm_dirs

pytestmark = pytest.mark.slow

KINDS = ("kill", "hang", "nan", "node")
REASON = {"kill": "Crash", "hang": "Hang", "nan": "NonFiniteLoss"}
SEEDS = [int(s) for s in os.environ.get("TIERCKPT_SOAK_SEEDS", "7").split(",") if s.strip()]
FAULTS = int(os.environ.get("TIERCKPT_SOAK_FAULTS", "6"))
#: healthy steps between a recovery and the next fault: at least --healthy-after-steps (10) even
#: where the launcher sees a generation's first step a beat late, so no fault of the soak earns a
#: backoff (backoff is for crash loops: before issue 24 item 2 it grew to 7-15 s by the fifth fault)
GAP = (12, 16)


@dataclass
class Plan:
    """A seeded schedule: (kind, rank, healthy steps before it), every kind at least once."""

    seed: int
    faults: list[tuple[str, int, int]] = field(default_factory=list)

    @classmethod
    def draw(cls, seed: int, n: int) -> Plan:
        rng = random.Random(seed)
        kinds = [*KINDS, *(rng.choice(KINDS) for _ in range(max(0, n - len(KINDS))))]
        rng.shuffle(kinds)
        return cls(seed, [(k, 1 if k == "node" else rng.randint(0, 1), rng.randint(*GAP)) for k in kinds])

    @property
    def steps(self) -> int:
        return 12 + sum(gap for _, _, gap in self.faults) + 8 * len(self.faults)


def _train(steps: int, inject: Path, inprocess: bool) -> list[str]:
    return ["--steps", str(steps), "--step-time", "0.1", "--optim", "adamw", "--inject-dir", str(inject),
            *(["--inprocess"] if inprocess else [])]


def _job(tmp: Path, shm: Any, steps: int, inprocess: bool) -> LocalJob:
    inject = tmp / "inject"
    inject.mkdir(parents=True, exist_ok=True)
    return LocalJob(tmp, shm, train=_train(steps, inject, inprocess), node_timeout=10.0, max_restarts=50)


def _final(job: LocalJob) -> dict[int, dict[str, Any]]:
    return {r: torch.load(job.work / f"final_rank{r}.pt", weights_only=True) for r in (0, 1)}


def _bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a.keys(), b.keys())
        for k in a:
            _bitwise_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, tuple[dict[int, Any], float]]]:
    """Final state and wall time of a fault-free run, per number of steps (on first use)."""
    class Lazy(dict[int, tuple[dict[int, Any], float]]):
        def __missing__(self, steps: int) -> tuple[dict[int, Any], float]:
            job = _job(tmp_path_factory.mktemp(f"ref{steps}"), shm, steps, inprocess=False)
            try:
                t0 = time.monotonic()
                job.start()
                assert job.wait_exit(300) == {0: 0, 1: 0}, job.report()
                self[steps] = (_final(job), time.monotonic() - t0)
            finally:
                job.close()
            return self[steps]

    with shm_dirs("tierckpt-soakref") as shm:
        yield Lazy()


def _progress_after(job: LocalJob, t: float) -> int:
    """The lowest newest step of the two ranks among steps taken after time ``t`` (-1: none)."""
    return min(max((e["step"] for e in job.trace(r) if e["event"] == "step" and e["time"] > t), default=-1)
               for r in (0, 1))


def _inject(job: LocalJob, kind: str, rank: int) -> None:
    if kind == "kill":
        os.kill(job.worker_pid(rank), signal.SIGKILL)
    elif kind == "hang":
        os.kill(job.worker_pid(rank), signal.SIGSTOP)
    elif kind == "nan":
        (job.work.parent / "inject" / f"nan_rank{rank}").touch()
    else:  # node 1's machine is gone; a new one with an empty memory root takes its place
        job.kill_machine(1)
        for entry in os.scandir(job.memory[1]):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        job.start_agent(1)


def _new_faults(job: LocalJob, seen: int) -> list[dict[str, Any]]:
    faults = sorted((e for e in job.events() if e["event"] == "fault"), key=lambda e: e["time"])
    by_gen: dict[tuple[int, int], dict[str, Any]] = {}
    for e in faults:  # every agent reports the claimed fault of a generation (or in-process generation)
        by_gen.setdefault((int(e["generation"]), int(e.get("inprocess") or 0)), e)
    return sorted(by_gen.values(), key=lambda e: e["time"])[seen:]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("inprocess", [True, False], ids=["resilient", "process"])
@pytest.mark.parametrize("seed", SEEDS)
def test_chaos_soak_ends_bit_identical_to_a_fault_free_run(
        tmp_path: Path, shm: Any, reference: dict[int, tuple[dict[int, Any], float]], seed: int,
        inprocess: bool) -> None:
    plan = Plan.draw(seed, FAULTS)
    want, ref_wall = reference[plan.steps]
    job = _job(tmp_path / "soak", shm, plan.steps, inprocess)
    rows: list[dict[str, Any]] = []
    try:
        t0 = time.monotonic()
        job.start()
        rows = drive(job, plan.faults)
        codes = job.wait_exit(300)
        wall = time.monotonic() - t0
        assert codes == {0: 0, 1: 0}, job.report()
        faults = _new_faults(job, 0)
        assert len(faults) == len(plan.faults), ("one fault reported per fault injected", faults, job.report())
        for row in rows:
            f = row["fault"]
            if row["kind"] != "node":  # see the module docstring
                assert f["reason"] == REASON[row["kind"]], (row["kind"], f, job.report())
                assert f["rank"] == row["rank"], ("the rank hit is blamed", row["kind"], f)
        node_loss = [e for e in job.events(1) if e["event"] == "agent"]
        assert len(node_loss) == 1 + sum(k == "node" for k, _, _ in plan.faults), "a new agent per lost node"
        restarts = [e for e in job.events(0) if e["event"] == "restart"]
        assert len(restarts) == len(plan.faults), ("one restart per fault, none spurious", restarts)
        backoffs = [e for e in job.events() if e["event"] == "backoff"]
        assert not backoffs, ("no backoff after healthy progress", backoffs)
        for r in (0, 1):
            saved = {(e["step"], e["digest"]) for e in job.trace(r) if e["event"] == "step"}
            for e in job.trace(r):
                if e["event"] == "resumed" and e["step"] is not None:
                    assert (e["step"], e["digest"]) in saved, ("resumed a state never saved at its step", r, e)
        got = _final(job)
        for r in (0, 1):
            _bitwise_equal(got[r], want[r], f"rank {r}")
    finally:
        job.close()
    _report(job, plan, rows, wall, ref_wall, inprocess)


def drive(job: LocalJob, faults: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    """Inject ``faults`` (kind, rank, healthy steps before it) into a started job, one after the
    other, each once training went ``gap`` steps past the previous recovery; the rows of what happened."""
    rows: list[dict[str, Any]] = []
    done_at, t_done = 0, 0.0
    for i, (kind, rank, gap) in enumerate(faults):
        target = done_at + gap
        job.wait_for(lambda t=t_done, s=target: _progress_after(job, t) >= s, 240,
                     f"fault {i} ({kind}): both ranks reach step {target}")
        at = job.last_step(rank)
        t_inject = time.time()
        _inject(job, kind, rank)
        fault = job.wait_for(lambda n=i: (_new_faults(job, n) or [None])[0], 120,
                             f"fault {i} ({kind}) is reported")
        t_done = fault["time"]
        done_at = job.wait_for(lambda t=t_done, a=at: (s := _progress_after(job, t)) > a and s, 240,
                               f"fault {i} ({kind}): training goes past step {at} again")
        rows.append({"kind": kind, "rank": rank, "step": at, "t_inject": t_inject, "fault": fault})
    return rows


def _report(job: LocalJob, plan: Plan, rows: list[dict[str, Any]], wall: float, ref_wall: float,
            inprocess: bool) -> None:
    backoff = sum(float(e["delay_s"]) for e in job.events(0) if e["event"] == "backoff")
    redone = 0
    lost: dict[str, list[float]] = {}  # kind -> seconds from the fault to training again
    print(f"\nsoak seed {plan.seed} ({'resilient' if inprocess else 'process'}), {len(rows)} faults, "
          f"{plan.steps} steps: wall {wall:.1f} s against {ref_wall:.1f} s fault-free "
          f"(extra {wall - ref_wall:.1f} s, {(wall - ref_wall) / len(rows):.1f} s per fault; backoff {backoff:.1f} s)")
    for row in rows:
        f = row["fault"]
        # each rank's first resume after the fault was injected (an in-process restart is reported
        # by the agent after the workers resumed: the fault event may come later than the resume)
        back = [next((e for e in job.trace(r) if e["event"] == "resumed" and e["time"] > row["t_inject"]), None)
                for r in (0, 1)]
        resumed = min((e["step"] or 0 for e in back if e is not None), default=row["step"])
        redone += max(0, row["step"] - resumed)
        since = max((e["time"] for e in back if e is not None), default=f["time"])
        first = min((e["time"] for r in (0, 1) for e in job.trace(r)
                     if e["event"] == "step" and e["time"] > since), default=float("nan"))
        lost.setdefault(row["kind"], []).append(first - row["t_inject"])  # detection included
        print(f"  {row['kind']:<4} rank {row['rank']} at step {row['step']:>3}: {f['reason']} (node {f.get('node')}, "
              f"rank {f.get('rank')}) reported {f['time'] - row['t_inject']:.2f} s and training again "
              f"{first - row['t_inject']:.2f} s after the fault, resumed step {resumed}")
    print(f"  steps redone {redone}; from the fault to training again, mean per kind: "
          + ", ".join(f"{k} {sum(v) / len(v):.2f} s" for k, v in sorted(lost.items())))
