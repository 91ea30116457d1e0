"""``tierckpt bench local``: tierckpt against memcpy, torch.save and DCP, same state, same run.

    tierckpt bench local [--size-mib 2048] [--tensors 64] [--world-size 1|2] [--repeats 3]
                         [--methods NAME,...] [--leak-mib SIZE] [--leak-saves 50] [--json PATH]
    python -m tierckpt.bench.local [same options]

Methods (all by default, run in this order): memcpy_numpy, memcpy_torch, torch_save, dcp_fs,
dcp_async, tierckpt, training, first_saves, tierckpt_dcp, paired, leak (training and
first_saves: see ``tierckpt.bench.training``). A line is printed as each method finishes,
the table at the end. The leak check saves a state of ``--leak-mib`` (default: --size-mib). Each figure is the median of ``--repeats`` timed
runs after one warm-up (two for tierckpt, whose first two saves each allocate a shared-memory
slot; the JSON keeps warm-up times); every load is checked bitwise against what was saved. The report
ends with the goals of issue 4 (ARCHITECTURE.md section 7), each PASS or MISS with the
ratio measured in this run.

Everything the run writes lives in one fresh directory under ``--shm-dir`` (default
/dev/shm), removed at exit, on error, on Ctrl-C and on SIGTERM.
Exit codes: 0 the run finished (goal verdicts are in the report, not the exit code);
1 a round trip gave back different bytes, or a rank failed; 2 bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from tierckpt.bench import report, runner
from tierckpt.bench.measure import StateSpec, cpu_pressure, load_average

__all__ = ["main"]

_MIB = 2**20


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tierckpt bench local",
        description="Time tierckpt against memcpy, torch.save and PyTorch DCP on /dev/shm, in one run.",
    )
    p.add_argument("--size-mib", type=int, default=2048, help="state dict size in MiB (default 2048)")
    p.add_argument("--tensors", type=int, default=64, help="float32 tensors in the state (default 64)")
    p.add_argument("--world-size", type=int, choices=(1, 2), default=1,
                   help="1: this process; 2: two gloo ranks on 127.0.0.1, each holding half")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per figure after the warm-up (default 3)")
    p.add_argument("--methods", default="all",
                   help="comma-separated subset of: " + ", ".join(runner.ALL_METHODS) + " (default all)")
    p.add_argument("--leak-mib", type=int, default=None, help="state size of the leak check (default: --size-mib)")
    p.add_argument("--leak-saves", type=int, default=50, help="saves in the leak check (default 50)")
    p.add_argument("--shm-dir", default="/dev/shm", help="tmpfs for the run's scratch directory")
    p.add_argument("--json", metavar="PATH", help="also write every figure, run and verdict here")
    return p


def _methods(p: argparse.ArgumentParser, spec: str) -> tuple[str, ...]:
    if spec == "all":
        return runner.ALL_METHODS
    chosen = {m.strip() for m in spec.split(",") if m.strip()}
    unknown = sorted(chosen - set(runner.ALL_METHODS))
    if unknown or not chosen:
        p.error(f"--methods: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(runner.ALL_METHODS)}")
    return tuple(m for m in runner.ALL_METHODS if m in chosen)


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    methods = _methods(p, args.methods)
    if args.leak_mib is None:
        args.leak_mib = args.size_mib
    for name in ("size_mib", "tensors", "repeats", "leak_mib", "leak_saves"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        spec = StateSpec.for_size(args.size_mib * _MIB, args.tensors, args.world_size)
        leak_spec = StateSpec.for_size(args.leak_mib * _MIB, args.tensors, args.world_size)
    except ValueError as exc:
        p.error(str(exc))
    if not os.path.isdir(args.shm_dir):
        p.error(f"--shm-dir {args.shm_dir!r} is not a directory; point it at a tmpfs such as /dev/shm")
    with _scratch_dir(args.shm_dir) as root:
        opts = runner.Options(
            size_bytes=spec.nbytes, tensors=args.tensors, world_size=args.world_size,
            repeats=args.repeats, methods=methods, leak_bytes=leak_spec.nbytes,
            leak_saves=args.leak_saves, root=str(root),
        )
        env: dict[str, Any] = {
            "torch": torch.__version__, "cpus": os.cpu_count(),
            "torch_threads": 1 if args.world_size > 1 else torch.get_num_threads(),
            "load_average_start": list(load_average()), "cpu_pressure_start": cpu_pressure(),
        }
        print(f"tierckpt bench (local): {spec.nbytes / 2**30:.3f} GiB in {args.tensors} tensors, world size "
              f"{args.world_size}: {', '.join(methods)}", flush=True)
        try:
            merged = runner.run(opts)
        except _rank_failures() as exc:
            print(f"tierckpt bench: a rank failed:\n{exc}", file=sys.stderr)
            return 1
        env.update(load_average_end=list(load_average()), cpu_pressure_end=cpu_pressure())
    doc: dict[str, Any] = {
        "tool": "tierckpt bench (local)",
        "argv": list(sys.argv[1:] if argv is None else argv),
        "config": {
            "state_bytes": spec.nbytes, "tensors": args.tensors, "world_size": args.world_size,
            "repeats": args.repeats, "methods": list(methods), "leak_state_bytes": leak_spec.nbytes,
            "leak_saves": args.leak_saves,
        },
        "env": env,
        **report.summarise(merged, spec.nbytes, leak_spec.nbytes),
    }
    print(report.format_report(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if doc["failures"] else 0


def _rank_failures() -> tuple[type[BaseException], ...]:
    """What ``torch.multiprocessing.spawn`` raises when a rank fails."""
    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

    return (ProcessRaisedException, ProcessExitedException)


@contextlib.contextmanager
def _scratch_dir(parent: str) -> Iterator[Path]:
    """A fresh directory under ``parent``, removed on exit, on error and on SIGTERM."""
    path = Path(tempfile.mkdtemp(prefix=f"tierckpt-bench-{os.getpid()}-", dir=parent))
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if in_main else None
    try:
        yield path
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(path, ignore_errors=True)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
