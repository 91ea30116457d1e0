"""Saves inside a training loop: the stall an overlapped save leaves, the loop's slowdown, cold saves.

``training_loop``: a loop whose step is a fixed amount of compute (matmuls, calibrated at
the start to ``STEP_X`` times a memcpy of the state, so the step is longer than the copy)
followed by an optimizer step (``torch.optim.SGD`` updating every state tensor in place).
Each round times, back to back: a memcpy of the state (the anchor), ``LOOP_STEPS`` steps
without saves, with a blocking ``Checkpointer.save`` every step, and with an overlapped
save every step (``overlap=True``, the optimizer fenced by ``register_fence``); a step saves
first (the state the last optimizer step left), computes, then steps the optimizer. The visible
stall of a save is the time the training thread spends in it: the ``save`` call plus the
wait at the fence (taken by an explicit ``ck.fence()`` just before ``opt.step()``). The last
overlapped save is loaded back and compared bitwise with the state at its call.

``first_saves``: a fresh Checkpointer per round: the first save (allocates its slot), the
background reservation of the next slots (timed apart, not in any save), then ``LATER``
saves; every save's call (the blocking part) is timed, the commit waited for untimed.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import tierckpt
from tierckpt.bench.measure import VerificationError, check_equal, median
from tierckpt.bench.methods import Rank, Recorder

__all__ = ["LATER", "LOOP_STEPS", "STEP_X", "TRAINING", "first_saves", "training_loop"]

STEP_X = 4.0  # a training step's compute, in memcpys of the state
LOOP_STEPS = 3  # steps per variant per round
LATER = 4  # saves after the first, per round


def _loop_state(ctx: Rank) -> tuple[dict[str, torch.Tensor], torch.optim.Optimizer]:
    """This rank's tensors as parameters (keys prefixed by rank: each rank saves its own) and an SGD."""
    params: dict[str, torch.Tensor] = {}
    for i, t in enumerate(ctx.expected):
        p = torch.nn.Parameter(t.clone(), requires_grad=True)
        p.grad = torch.full_like(t, 1e-3)
        params[f"r{ctx.rank}.t{i:03d}"] = p
    return params, torch.optim.SGD(params.values(), lr=1e-3)


def _calibrate(seconds: float) -> tuple[torch.Tensor, int]:
    """A matmul operand and the number of matmuls that take about ``seconds``."""
    a = torch.rand(384, 384)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.2:
        a @ a
        n += 1
    per = (time.perf_counter() - t0) / n
    return a, max(1, round(seconds / per))


def _compute(a: torch.Tensor, n: int) -> None:
    for _ in range(n):
        a @ a


def _memcpy(params: dict[str, torch.Tensor], dst: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        for d, p in zip(dst, params.values(), strict=True):
            d.copy_(p)
    return time.perf_counter() - t0


def training_loop(ctx: Rank, rec: Recorder) -> None:
    params, opt = _loop_state(ctx)
    dst = [torch.empty_like(p) for p in params.values()]
    _memcpy(params, dst)
    a, n = _calibrate(STEP_X * min(_memcpy(params, dst) for _ in range(3)))
    cfg = tierckpt.CheckpointConfig(namespace="train", memory_dir=str(ctx.fresh_dir("train")),
                                    memory_steps_retained=1)
    state = {"params": params}
    step = 0
    with tierckpt.Checkpointer(cfg) as ck:
        ck.register_fence(opt)
        for run in ctx.runs(2):
            ctx.barrier()
            rec.add(run, "copy", _memcpy(params, dst), None)
            for variant in ("nosave", "blocking", "overlap"):
                ctx.barrier()
                steps, stalls, fences = [], [], []
                for _ in range(LOOP_STEPS):
                    step += 1
                    t0 = time.perf_counter()
                    stall = 0.0
                    if variant != "nosave":  # the state after the last optimizer step, then forward/backward
                        ck.save(step, state, overlap=variant == "overlap")
                        stall = time.perf_counter() - t0
                    _compute(a, n)
                    f0 = time.perf_counter()
                    ck.fence()
                    fences.append(time.perf_counter() - f0)
                    opt.step()
                    steps.append(time.perf_counter() - t0)
                    stalls.append(stall + fences[-1])
                rec.add(run, f"step_{variant}", median(steps), None)
                if variant != "nosave":
                    rec.add(run, f"stall_{variant}", median(stalls), None)
                if variant == "overlap":
                    rec.add(run, "fence_overlap", median(fences), None)
            ck.wait()
        rec.checks["overlap_snapshot"] = _overlap_snapshot_holds(ctx, ck, state, opt, step + 1)
    ctx.remove("train")


def _overlap_snapshot_holds(ctx: Rank, ck: tierckpt.Checkpointer, state: dict[str, Any],
                            opt: torch.optim.Optimizer, step: int) -> bool:
    """An overlapped save, then the optimizer step at once: the step holds the values at the call."""
    at_call = [p.detach().clone() for p in state["params"].values()]
    ck.save(step, state, overlap=True).wait_staged()
    opt.step()
    ck.wait()
    target = {"params": {k: torch.zeros_like(p) for k, p in state["params"].items()}}
    loaded = ck.load(target)
    problem = "" if loaded == step else f"loaded step {loaded}, expected {step}"  # "": checked here, not by verify
    if not problem:
        try:
            check_equal(at_call, list(target["params"].values()), "overlapped save in the loop")
        except VerificationError as exc:
            problem = str(exc)
    ctx.verify("overlapped save in the loop", problem=problem)
    return not problem


def first_saves(ctx: Rank, rec: Recorder) -> None:
    state = {f"r{ctx.rank}.t{i:03d}": t for i, t in enumerate(ctx.expected)}
    for run in ctx.runs(1):
        cfg = tierckpt.CheckpointConfig(namespace=f"first{run + 1}", memory_dir=str(ctx.fresh_dir(f"first{run + 1}")),
                                        memory_steps_retained=1)
        with tierckpt.Checkpointer(cfg) as ck:
            ctx.barrier()
            t0 = time.perf_counter()
            handle = ck.save(1, state)
            rec.add(run, "first", time.perf_counter() - t0, None)
            handle.wait()
            t0 = time.perf_counter()
            ck.reserve(state, wait=True)  # what runs in the background between saves
            rec.add(run, "reserve", time.perf_counter() - t0, None)
            later = []
            for step in range(2, 2 + LATER):
                ctx.barrier()
                t0 = time.perf_counter()
                handle = ck.save(step, state)
                later.append(time.perf_counter() - t0)
                handle.wait()
            rec.add(run, "later", median(later), None)
            rec.add(run, "later_max", max(later), None)
        ctx.remove(f"first{run + 1}")


TRAINING = {"training": training_loop, "first_saves": first_saves}
