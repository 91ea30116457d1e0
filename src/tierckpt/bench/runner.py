"""One local benchmark run across ranks: build the state, run the chosen methods, merge the figures.

World size 1 runs in the calling process with torch's default threads. World size 2 spawns
two processes (``torch.multiprocessing.spawn``, gloo on 127.0.0.1 through a TCPStore the
parent owns, one torch thread each: the two ranks share the machine), each holding half of
every tensor as a DTensor ``Shard(0)``. Rank figures merge per timed run: seconds as the
slowest rank (what the job waits for), RSS as the sum of the ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import start_processes

from tierckpt.bench.measure import StateSpec, VerificationError, build_state, empty_like_state
from tierckpt.bench.methods import METHODS, Rank, Recorder, leak_check
from tierckpt.bench.training import TRAINING

__all__ = ["ALL_METHODS", "TIMED", "Options", "merge", "progress_line", "run"]

# the training-loop methods right after tierckpt's own (the DCP plug-in stays near the end:
# its process-wide runtime keeps slots mapped until exit)
_order = list(METHODS)
_at = _order.index("tierckpt") + 1
TIMED: dict[str, Any] = {name: {**METHODS, **TRAINING}[name] for name in [*_order[:_at], *TRAINING, *_order[_at:]]}
ALL_METHODS = (*TIMED, "leak")
_TIMEOUT = datetime.timedelta(minutes=20)


@dataclass(frozen=True)
class Options:
    """One run's settings; ``root`` is this run's own scratch directory on /dev/shm."""

    size_bytes: int
    tensors: int
    world_size: int
    repeats: int
    methods: tuple[str, ...]
    leak_bytes: int
    leak_saves: int
    root: str
    progress: bool = True  #: rank 0 prints a line per method as it finishes


def run(opts: Options) -> dict[str, Any]:
    """Every rank's figures, merged (see the module docstring)."""
    if opts.world_size == 1:
        return merge([run_rank(0, opts)])
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, None, True, timeout=_TIMEOUT, wait_for_workers=False
    )
    out = Path(opts.root) / "result.json"
    ctx = start_processes(
        _spawned, args=(opts, store.port, str(out)), nprocs=opts.world_size, join=False, start_method="spawn"
    )
    try:
        while not ctx.join():  # raises when a rank fails (and ends the other ranks)
            pass
    finally:
        for proc in ctx.processes:  # on Ctrl-C or SIGTERM in the parent, end the ranks too
            if proc.is_alive():
                proc.kill()
            proc.join()
        for name in ctx.error_files:  # a failed rank leaves its traceback in the temp dir
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
        del store
    merged: dict[str, Any] = json.loads(out.read_text())
    return merged


def _spawned(rank: int, opts: Options, port: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_TIMEOUT)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=opts.world_size, timeout=_TIMEOUT)
    try:
        result = run_rank(rank, opts)
        gathered: list[Any] = [None] * opts.world_size
        dist.all_gather_object(gathered, result)
        if rank == 0:
            Path(out).write_text(json.dumps(merge(gathered)))
    finally:
        dist.destroy_process_group()


def run_rank(rank: int, opts: Options) -> dict[str, Any]:
    """This rank's raw figures: {"methods": {name: figures}, "checks", "failures": {name: why}, "leak"}."""
    ws = opts.world_size
    mesh = None
    if ws > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (ws,))
    root = Path(opts.root)
    out: dict[str, Any] = {"methods": {}, "checks": {}, "failures": {}, "leak": None}
    with warnings.catch_warnings():
        # DCP without a process group (world size 1) warns on every call
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        timed = [m for m in opts.methods if m in TIMED]
        if timed:
            state = build_state(StateSpec.for_size(opts.size_bytes, opts.tensors, ws), rank, ws, mesh)
            ctx = Rank(rank, ws, state, empty_like_state(state), root, opts.repeats)
            for name in timed:
                rec = Recorder()
                try:
                    TIMED[name](ctx, rec)
                except VerificationError as exc:  # raised on every rank alike: go on together
                    out["failures"][name] = str(exc)
                    continue
                out["methods"][name] = rec.figures
                out["checks"].update({f"{name}.{k}": v for k, v in rec.checks.items()})
                if opts.progress and rank == 0:
                    print(progress_line(name, rec.figures), flush=True)
                gc.collect()
            del ctx, state
            gc.collect()
        if "leak" in opts.methods:
            state = build_state(StateSpec.for_size(opts.leak_bytes, opts.tensors, ws), rank, ws, mesh)
            ctx = Rank(rank, ws, state, {}, root, 0)
            out["leak"] = leak_check(ctx, state, opts.leak_saves)
            if opts.progress and rank == 0:
                anon = out["leak"]["tierckpt"]
                print(f"  done leak: {len(anon)} saves, anonymous RSS {anon[0] / 2**20:.0f} -> "
                      f"{anon[-1] / 2**20:.0f} MiB (this rank)", flush=True)
    return out


def progress_line(name: str, figures: dict[str, dict[str, list[Any]]]) -> str:
    """``  done NAME: fig median s, ...`` (this rank's figures, before the merge)."""
    parts = [f"{fig} {sorted(f['s'])[len(f['s']) // 2]:.4f}s" for fig, f in figures.items() if f["s"]]
    return f"  done {name}: " + ", ".join(parts)


def _source(per_rank: tuple[str | None, ...]) -> str | None:
    if None in per_rank:
        return None
    return "sampled" if "sampled" in per_rank else "hwm"


def merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Ranks' raw figures as one: per run, the slowest rank's seconds and the sum of RSS."""
    first = per_rank[0]
    methods: dict[str, Any] = {}
    for name, figures in first["methods"].items():
        methods[name] = {}
        for fig in figures:
            runs = [r["methods"][name][fig] for r in per_rank]
            seconds = [max(col) for col in zip(*(r["s"] for r in runs), strict=True)]
            rss = [None if None in col else sum(col) for col in zip(*(r["rss"] for r in runs), strict=True)]
            sources = [_source(col) for col in zip(*(r["rss_source"] for r in runs), strict=True)]
            warmups = [max(col) for col in zip(*(r["warmup_s"] for r in runs), strict=True)]
            methods[name][fig] = {"runs_s": seconds, "rss_runs": rss, "rss_source": sources, "warmup_s": warmups}
    checks = {k: all(r["checks"][k] for r in per_rank) for k in first["checks"]}
    leak = None
    if first["leak"] is not None:
        leak = {
            name: [sum(col) for col in zip(*(r["leak"][name] for r in per_rank), strict=True)]
            for name in first["leak"]
        }
    return {"methods": methods, "checks": checks, "failures": first["failures"], "leak": leak}
