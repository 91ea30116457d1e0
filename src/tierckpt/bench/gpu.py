"""``tierckpt bench gpu``: on a CUDA machine, the training stall of an overlapped save against the
device-to-host copy of the same bytes, and the stages of an in-process restart (NCCL).

    tierckpt bench gpu [--mib 1024] [--repeats 5] [--shm-dir /dev/shm] [--json PATH]

1. Overlapped save: ``--mib`` MiB of CUDA tensors; the figure is the time ``Checkpointer.save(
   step, state, overlap=True)`` blocks the caller (the stall), beside one pinned
   ``copy_(non_blocking=True)`` + synchronize of the same bytes (the device-to-host limit)
   and the time until the save's copy finished (``handle.wait_staged()``).
2. In-process restart on one rank with NCCL: a compiled model on the GPU; generation 0 raises
   at step 3, ``tierckpt.resilient`` aborts the NCCL group and re-creates it; printed: leave,
   stop (abort + destroy), barrier, process group, load, first step (a compiled graph reused:
   no recompile expected) and the whole recovery.

Without CUDA it prints a line saying so and exits 2. Exit codes: 0 measured; 2 no CUDA or bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]

NO_GPU_EXIT = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierckpt bench gpu", description="GPU: overlapped save stall, in-process restart")
    p.add_argument("--mib", type=int, default=1024, help="MiB of CUDA tensors to save (default 1024)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--json", metavar="PATH")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("tierckpt bench gpu: skipped: no CUDA device here (torch.cuda.is_available() is False); "
              "run it on a GPU machine (docs/benchmarks.md)")
        return NO_GPU_EXIT
    doc: dict[str, Any] = {"tool": "tierckpt bench (gpu)", "device": torch.cuda.get_device_name(0),
                           "torch": torch.__version__}
    doc["save"] = overlapped_save(args.mib, args.repeats, args.shm_dir)
    doc["inprocess"] = inprocess_restart(args.shm_dir)
    print(format_report(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def overlapped_save(mib: int, repeats: int, shm_dir: str) -> dict[str, Any]:
    """Medians of: the D2H copy of the bytes, the overlapped save's stall and its copy's end."""
    import torch

    import tierckpt

    n = mib * 2**20 // 4 // 8
    state = {f"w{i}": torch.randn(n, device="cuda") for i in range(8)}
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}
    d2h, stall, staged = [], [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, v in state.items():
            pinned[k].copy_(v, non_blocking=True)
        torch.cuda.synchronize()
        d2h.append(time.perf_counter() - t0)
    root = tempfile.mkdtemp(prefix="tierckpt-bench-gpu-", dir=shm_dir)
    cfg = tierckpt.CheckpointConfig(namespace="bench-gpu", memory_dir=root, memory_steps_retained=2)
    with tierckpt.Checkpointer(cfg) as ck:
        ck.reserve(state)
        for step in range(1, repeats + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            handle = ck.save(step, state, overlap=True)
            t1 = time.perf_counter()
            handle.wait_staged()
            t2 = time.perf_counter()
            if step > 1:  # the first save plans; the others are the steady state
                stall.append(t1 - t0)
                staged.append(t2 - t0)
        ck.wait()
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    return {"bytes": sum(v.numel() * 4 for v in state.values()), "d2h_s": statistics.median(d2h),
            "stall_s": statistics.median(stall), "staged_s": statistics.median(staged)}


def inprocess_restart(shm_dir: str) -> dict[str, Any]:
    """One NCCL rank under ``tierckpt.resilient``: a fault at step 3 of generation 0, recovery timed."""
    import torch
    import torch.distributed as dist

    import tierckpt
    import tierckpt.monitor as monitor

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward = torch.compile(model)
    root = tempfile.mkdtemp(prefix="tierckpt-bench-gpu-ip-", dir=shm_dir)
    cfg = tierckpt.CheckpointConfig(namespace="bench-gpu-ip", memory_dir=root)
    out: dict[str, Any] = {}

    def train(gen: tierckpt.Generation) -> None:
        with tierckpt.Checkpointer(cfg) as ck:
            state = {"model": model.state_dict(), "optim": optim.state_dict()}
            t0 = time.perf_counter()
            start = ck.load(state) or 0
            torch.cuda.synchronize()
            load_s = time.perf_counter() - t0
            for step in range(start + 1, 6):
                t1 = time.perf_counter()
                x = torch.randn(256, 1024, device="cuda")
                loss = forward(x).square().mean()
                loss.backward()
                t = torch.ones(1, device="cuda")
                dist.all_reduce(t)
                optim.step()
                optim.zero_grad()
                torch.cuda.synchronize()
                if gen.index == 1 and step == start + 1:
                    out.update(stages_s={**gen.stages_s, "load": load_s, "first_step": time.perf_counter() - t1},
                               recovery_s=time.time() - (gen.fault_time or time.time()), resumed_step=start)
                if gen.index == 0 and step == 3:
                    raise RuntimeError("a fault at step 3 (as asked)")
                monitor.step(step, loss=float(loss))
                ck.save(step, {"model": model.state_dict(), "optim": optim.state_dict()})

    t0 = time.perf_counter()
    tierckpt.resilient(train, backend="nccl")()
    out["total_s"] = time.perf_counter() - t0
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    return out


def format_report(doc: dict[str, Any]) -> str:
    sv, ip = doc["save"], doc["inprocess"]
    gib = sv["bytes"] / 2**30
    lines = [f"\ntierckpt bench gpu on {doc['device']} (torch {doc['torch']})",
             f"  overlapped save of {gib:.2f} GiB of CUDA tensors (medians)",
             f"    device-to-host copy of the same bytes (pinned)  {sv['d2h_s'] * 1e3:9.1f} ms  "
             f"({gib / sv['d2h_s']:.1f} GiB/s)",
             f"    stall: save(overlap=True) returns after       {sv['stall_s'] * 1e3:9.1f} ms  "
             f"({sv['stall_s'] / sv['d2h_s']:.3f} x the copy)",
             f"    the save's copy finished after                  {sv['staged_s'] * 1e3:9.1f} ms",
             "  in-process restart, 1 rank, NCCL, compiled model (exception at step 3)"]
    for k, v in ip.get("stages_s", {}).items():
        lines.append(f"    {k:<46}  {v * 1e3:9.1f} ms")
    if "recovery_s" in ip:
        lines.append(f"    {'fault -> first step done':<46}  {ip['recovery_s'] * 1e3:9.1f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
