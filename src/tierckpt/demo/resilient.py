"""A small training job for ``tierckpt run``: the demo, the recovery benchmark and the scenario tests.

Run by a launcher (``tierckpt run`` or torchrun) with gloo on CPU: a tiny MLP, gradients
all-reduced by hand (no DDP, whose lazy imports would dominate a restart), a
``Checkpointer.save`` to the memory tier every step, a heartbeat and a seed-style log line
("Batch 3 Loss: 0.12345, Speed: ...") per step. It records what it did as JSON lines in
``<workdir>/trace_rank<r>.jsonl`` (``start``, ``imported``, ``pg`` (after ``init_process_group``),
``resumed``, ``step``, ``done`` with times and the generation) so a driver can measure recovery
and check which step was resumed.

Faults on request (only in generation ``--fault-generation``, rank ``--fault-rank``):
``crash_on_start`` (exit 3 before the first step), ``stall_on_start`` (wait forever before it),
``nan`` (loss NaN at ``--fault-step``),
``silent`` (stop printing the loss line after ``--fault-step``), ``exit`` (exit 3 at that step),
``hang`` (block forever in a wait at that step, without a heartbeat: the other ranks block in
their next all-reduce, a collective that never returns), ``raise`` (an exception at that step),
``mismatch`` (at that step, before its all-reduce, a receive from the next rank, which never sends:
a communication the others never join, every rank then waits in torch, a deadlock), ``spin`` (a
Python loop that never ends at that step: busy, no heartbeat, the others wait in the all-reduce).
``--ballast-mib N``: an N MiB buffer per rank in the saved state (restore timing on a slow link).
``--compile``: the model is ``torch.compile``d once per process. ``--inprocess``: the training
loop runs under ``tierckpt.resilient`` (faults restart it in-process; a fault fires in the
first in-process generation only); traces then carry ``inproc`` (the in-process generation).
``--eval-every N --eval-s S``: after every Nth step every rank (``--eval-rank R``: rank R alone,
the others wait in the all-reduce) evaluates for S seconds (busy, no heartbeat), then all-reduces
the result, the way a legitimate slow step looks to the launcher; ``--eval-idle [sleep|pipe]``: it waits
instead (sleeps, or blocks reading a pipe that brings a byte a second), like a stall; ``--eval-section-timeout T``: inside ``monitor.section("eval", T)``.
With ``--fault-file PATH`` a fault starts at the first step that finds the file instead of at
``--fault-step``. ``--optim adamw``: AdamW instead of SGD (state beyond the parameters).
``--durable-sync``: each durable save (every ``--durable-every``) is waited for before the next step.
``--compile-s S``: the first step of every process compiles for S seconds (a busy child process).
``--inject-dir D``: a driver asks for a fault by creating ``D/nan_rank<r>``; the rank consumes
(deletes) the file at its next step and makes that step's loss, gradients and update NaN for
real, as a diverging step does (the chaos soak). ``--data DIR``: each step's batch comes from the
files in DIR (``tierckpt.testing.files``) through a shuffled ``tierckpt.data.ResumableLoader`` with
``--data-workers`` worker processes, ``--batch-size`` samples a rank, its position saved with the
model (``--no-data-restore``: saved, never restored; ``tierckpt.demo.data``); the first step after
each resume traces ``batch_s``, the time to its batch. At the end each rank writes its model and
optimizer state to ``<workdir>/final_rank<r>.pt`` (compared bit for bit with a fault-free run's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

NAMESPACE = "tierckpt-resilient"


def _trace(path: Path, event: str, **fields: Any) -> None:
    rec = {"event": event, "time": time.time(), "generation": int(os.environ.get("TIERCKPT_GENERATION", "-1")),
           "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1")),
           "job_restart_count": int(os.environ.get("JOB_RESTART_COUNT", "-1")), "pid": os.getpid(), **fields}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _digest(model: Any) -> str:
    """xxh3 of every parameter's and buffer's bytes: the resumed state must equal the saved one, bit for bit."""
    import xxhash

    h = xxhash.xxh3_64()
    for p in [*model.parameters(), *model.buffers()]:
        h.update(p.detach().contiguous().view(-1).numpy().tobytes())
    return h.hexdigest()


def _evaluate(model: Any, seconds: float, trace: Path, step: int, idle: str | None = None) -> None:
    """A busy (or ``idle``: sleeping, or blocked reading a slow pipe) evaluation pass of ``seconds``
    without a heartbeat, ending in an all-reduce."""
    import torch
    import torch.distributed as dist

    t0 = time.time()
    total = torch.zeros(())
    if idle == "sleep":
        time.sleep(seconds)
    elif idle == "pipe":  # a remote service that answers a byte a second: blocking reads, next to no I/O
        r, w = os.pipe()

        def trickle() -> None:
            for _ in range(max(1, round(seconds))):
                time.sleep(1.0)
                os.write(w, b".")
            os.close(w)

        import threading

        threading.Thread(target=trickle, daemon=True).start()
        while os.read(r, 1):
            pass
        os.close(r)
    with torch.no_grad():
        while time.time() - t0 < seconds:
            total += model(torch.randn(256, 32)).sum()
    dist.all_reduce(total)
    _trace(trace, "eval", step=step, eval_s=time.time() - t0)


def _compile(seconds: float) -> None:
    """``seconds`` of compilation in a child process while this thread waits (busy, no heartbeat)."""
    import subprocess

    subprocess.run([sys.executable, "-c", f"import time\nt = time.time() + {seconds}\nwhile time.time() < t: pass"],
                   check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--step-time", type=float, default=0.1)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--durable-every", type=int, default=0)
    ap.add_argument("--durable-sync", action="store_true",
                    help="wait for each durable save to land before the next step (a synchronous save)")
    ap.add_argument("--compile-s", type=float, default=0.0,
                    help="the first step of every process compiles for this long (in a child process, as "
                         "inductor's compile workers do; the main thread waits for it)")
    ap.add_argument("--global-mode", action="store_true",
                    help="one global DCP checkpoint (needs a durable tier across nodes); default: local mode")
    ap.add_argument("--fault", default="none",
                    choices=["none", "crash_on_start", "stall_on_start", "nan", "silent", "exit", "hang", "raise",
                             "mismatch", "spin"])
    ap.add_argument("--fault-step", type=int, default=5)
    ap.add_argument("--fault-generation", type=int, default=0, help="-1: every generation")
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--eval-s", type=float, default=8.0)
    ap.add_argument("--eval-rank", type=int, default=-1, help="-1: every rank evaluates")
    ap.add_argument("--eval-idle", nargs="?", const="sleep", choices=["sleep", "pipe"],
                    help="the evaluation waits instead of computing: sleeps, or reads a slow pipe (a byte a second)")
    ap.add_argument("--eval-section-timeout", type=float, default=0.0)
    ap.add_argument("--fault-file", help="fault at the first step that sees this file (instead of --fault-step)")
    ap.add_argument("--fault-memory-dir", help="the faulty worker is every rank of the node whose memory tier is this "
                    "directory (TIERCKPT_MEMORY_DIR: a node's identity), instead of --fault-rank")
    ap.add_argument("--fault-limit", type=int, default=0,
                    help="at most this many faults in all, counted in <workdir>/faults_done (0: no limit)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (built once per process)")
    ap.add_argument("--inprocess", action="store_true", help="run under tierckpt.resilient: in-process restarts")
    ap.add_argument("--optim", choices=["sgd", "adamw"], default="sgd")
    ap.add_argument("--inject-dir", help="NaN on request: a rank that finds <dir>/nan_rank<r> deletes it and diverges")
    ap.add_argument("--ballast-mib", type=int, default=0,
                    help="a buffer of this many MiB per rank in the model's state (saved, restored, a slice changed "
                    "every step; never all-reduced): a state whose copy takes time on a slow link")
    ap.add_argument("--data", help="read each step's batch from the sample files in this directory (shuffled, "
                    "through tierckpt.data.ResumableLoader with worker processes), its position saved with the model")
    ap.add_argument("--data-workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8, help="samples per rank and step (--data)")
    ap.add_argument("--no-data-restore", action="store_true",
                    help="--data: save the loader's position but never restore it (the data starts over)")
    ap.add_argument("--trace-sigterm", action="store_true",
                    help="on SIGTERM write a 'sigterm' trace event, then exit 143 (a graceful stop, seen); a collective "
                    "that fails because a peer died waits up to 60 s for that stop instead of exiting at once (the "
                    "survivor's stop is then always the launcher's)")
    args = ap.parse_args(argv)
    t_start = time.time()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    rank_env = int(os.environ.get("RANK", "0"))
    trace = work / f"trace_rank{rank_env}.jsonl"
    gen = int(os.environ.get("TIERCKPT_GENERATION", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    on_node = os.environ.get("TIERCKPT_MEMORY_DIR") == args.fault_memory_dir if args.fault_memory_dir \
        else rank_env == args.fault_rank
    faulty = args.fault_generation in (gen, -1) and on_node and not _faults_spent(args, work)
    if args.trace_sigterm:
        import signal

        def _on_sigterm(signum: int, _frame: Any) -> None:
            _trace(trace, "sigterm", signal=signum)
            os._exit(143)

        signal.signal(signal.SIGTERM, _on_sigterm)
    # under tierckpt run a warm standby (torch imported ahead) may be this process: say so
    _trace(trace, "start", interpreter_start=t_start, warm=os.environ.get("TIERCKPT_WARM") == "1",
           warm_since=float(os.environ.get("TIERCKPT_WARM_SINCE", "0")) or None,
           resume_before=os.environ.get("TIERCKPT_RESUME_BEFORE"))
    if faulty and args.fault == "crash_on_start":
        print("crashing on start (as asked)", flush=True)
        return 3
    if faulty and args.fault == "stall_on_start":  # never beats, never prints a loss line
        import threading

        threading.Event().wait()

    import torch
    import torch.distributed as dist

    import tierckpt  # noqa: F401 - the package's import time belongs to "imported"

    _trace(trace, "imported")
    torch.manual_seed(0)
    model: Any = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    if args.ballast_mib > 0:
        model.register_buffer("ballast", torch.randn(args.ballast_mib << 18, generator=torch.Generator().manual_seed(
            1000 + rank_env)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3) if args.optim == "adamw" \
        else torch.optim.SGD(model.parameters(), lr=0.05)
    forward = torch.compile(model) if args.compile else model  # built once: in-process restarts keep it
    data = None
    if args.data:  # built once, before the process group: in-process restarts keep it and its workers
        from tierckpt.demo.data import DemoData

        data = DemoData(restore=not args.no_data_restore)  # its loader from --data, --batch-size, --data-workers
    if args.inprocess:
        from tierckpt.inprocess import Generation, resilient

        def generation(gen: Generation) -> None:
            _trace(trace, "pg", inproc=gen.index, reason=gen.reason, stages_s=gen.stages_s, fault_time=gen.fault_time)
            _train(args, model, forward, optim, trace, faulty and gen.index == 0, inproc=gen.index, data=data)

        resilient(generation)()
    else:
        dist.init_process_group("gloo")
        _trace(trace, "pg")
        try:
            _train(args, model, forward, optim, trace, faulty, inproc=None, data=data)
        except RuntimeError as exc:  # gloo's "connection closed by peer" (DistBackendError is one too)
            if not args.trace_sigterm or "(as asked)" in str(exc):
                raise
            _trace(trace, "collective_failed", error=str(exc)[:200])
            time.sleep(60)  # the launcher stops this survivor first: 'sigterm', exit 143
            raise
        dist.destroy_process_group()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, work / f"final_rank{rank_env}.pt")
    _trace(trace, "done", step=args.steps)
    return 0


def _init_optim_state(optim: Any) -> None:
    """Create the optimizer's state (AdamW: step, moments) with one step of lr 0 on zero gradients.

    ``Checkpointer.load`` restores in place, into the tensors the state dict holds: a fresh
    optimizer has none, so a resumed AdamW would silently start its moments over (the load warns
    about the unloaded keys). The same on every start, with or without a checkpoint."""
    import torch

    if optim.state:
        return
    params = [p for g in optim.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optim.param_groups]
    for g in optim.param_groups:
        g["lr"] = 0.0
    optim.step()
    for g, lr in zip(optim.param_groups, lrs, strict=True):
        g["lr"] = lr
    optim.zero_grad(set_to_none=True)


def _take(inject_dir: str | None, rank: int) -> bool:
    """The driver asked this rank for a NaN (``--inject-dir``): consume the request, once."""
    if not inject_dir:
        return False
    try:
        os.unlink(os.path.join(inject_dir, f"nan_rank{rank}"))
        return True
    except FileNotFoundError:
        return False


def _faults_spent(args: argparse.Namespace, work: Path) -> bool:
    """``--fault-limit`` faults happened already (any node, any generation)."""
    if not args.fault_limit:
        return False
    try:
        return len((work / "faults_done").read_text().split()) >= args.fault_limit
    except FileNotFoundError:
        return False


def _train(args: argparse.Namespace, model: Any, forward: Any, optim: Any, trace: Path, faulty: bool,
           inproc: int | None, data: Any = None) -> None:
    """Load from memory, then train to ``args.steps`` with a save and a beat per step."""
    import torch
    import torch.distributed as dist

    import tierckpt
    import tierckpt.monitor as monitor

    work = Path(args.workdir)
    rank, world = dist.get_rank(), dist.get_world_size()
    (work / f"pid_rank{rank}").write_text(str(os.getpid()))
    cfg = tierckpt.CheckpointConfig.from_env(namespace=os.environ.get("TIERCKPT_NAMESPACE", NAMESPACE),
                                             durable_every_n_steps=args.durable_every,
                                             local_mode=not args.global_mode)
    with tierckpt.Checkpointer(cfg) as ck:
        _init_optim_state(optim)  # a load fills tensors in place: AdamW's moments must exist to be restored
        state: dict[str, Any] = {"model": model.state_dict(), "optim": optim.state_dict(), "step": 0,
                                 **(data.for_load() if data is not None else {})}
        t0 = time.time()
        resumed = ck.load(state)
        if resumed is not None:
            model.load_state_dict(state["model"])
            optim.load_state_dict(state["optim"])
        _trace(trace, "resumed", step=resumed, load_s=time.time() - t0, digest=_digest(model), inproc=inproc, world=world,
               tiers=(ck.last_load or {}).get("tiers") if resumed is not None else None,
               **({"loader_warm": data.warm, "prefetched": data.item.prefetched} if data is not None else {}))
        first = True
        batches = data.batches() if data is not None else None
        for step in range((resumed or 0) + 1, args.steps + 1):
            t_step = time.time()
            if batches is not None:
                x, y = next(batches)
                t_batch = time.time() - t_step
            else:
                g = torch.Generator().manual_seed(step * 100 + rank)
                x, y = torch.randn(64, 32, generator=g), torch.randint(0, 8, (64,), generator=g)
            loss = torch.nn.functional.cross_entropy(forward(x), y)
            injected = _take(args.inject_dir, rank)
            if injected:  # a real divergence: NaN gradients, a NaN update, held back by monitor.step below
                _trace(trace, "fault", step=step, fault="nan", inproc=inproc, injected=True)
                loss = loss * math.nan
            if first and args.compile_s > 0:
                _compile(args.compile_s)
            t_fwd = time.time() - t_step
            optim.zero_grad()
            loss.backward()
            for p in model.parameters():
                if p.grad is None:  # a parameter the loss does not reach
                    continue
                dist.all_reduce(p.grad)
                p.grad /= world
            optim.step()
            ballast = getattr(model, "ballast", None)
            if ballast is not None:  # every step changes the state saved: a resume from a stale copy shows
                at = (step * 65537) % max(1, ballast.numel() - 1024)
                ballast[at : at + 1024] += step
            value = float(loss)
            due = faulty and (os.path.exists(args.fault_file) if args.fault_file else step >= args.fault_step)
            if due and args.fault in ("nan", "exit", "raise", "hang", "mismatch", "spin"):
                _trace(trace, "fault", step=step, fault=args.fault, inproc=inproc)
                if args.fault_limit:
                    with open(work / "faults_done", "a") as f:
                        f.write(f"{os.getpid()}\n")
            if due and args.fault == "nan":
                value = math.nan
            if due and args.fault == "exit":
                print(f"exiting at step {step} (as asked)", flush=True)
                sys.exit(3)
            if due and args.fault == "raise":
                raise RuntimeError(f"failing at step {step} (as asked)")
            if due and args.fault == "mismatch":
                print(f"receiving from rank {(rank + 1) % world}, which never sends, at step {step} (as asked)",
                      flush=True)
                dist.recv(torch.zeros(1), src=(rank + 1) % world)
            if due and args.fault == "spin":
                print(f"spinning forever at step {step} (as asked)", flush=True)
                n = 0
                while n >= 0:
                    n = (n + 1) % 1000
            if due and args.fault == "hang":
                print(f"blocking forever at step {step} (as asked)", flush=True)
                import threading

                threading.Event().wait()
            if not (due and args.fault == "silent"):
                print(f"Batch {step} Loss: {value:.5f}, Speed: {64 / max(time.time() - t_step, 1e-6):.2f} samples/sec",
                      flush=True)
            monitor.step(step, loss=value)
            state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": step,
                     **(data.for_save() if data is not None else {})}
            ck.save(step, state)
            if args.durable_sync and args.durable_every and step % args.durable_every == 0:
                t_sync = time.time()
                ck.wait()  # the durable copy landed (or the wait raised)
                _trace(trace, "durable", step=step, wait_s=time.time() - t_sync)
            _trace(trace, "step", step=step, digest=_digest(model), inproc=inproc,
                   **({"forward_s": t_fwd} if first else {}), **({"fault": args.fault} if due else {}),
                   **({"batch_s": t_batch} if first and batches is not None else {}))
            first = False
            if args.eval_every and step % args.eval_every == 0:
                seconds = args.eval_s if args.eval_rank in (-1, rank) else 0.0
                if args.eval_section_timeout:
                    with monitor.section("eval", timeout_s=args.eval_section_timeout):
                        _evaluate(model, seconds, trace, step, idle=args.eval_idle)
                else:
                    _evaluate(model, seconds, trace, step, idle=args.eval_idle)
            time.sleep(max(0.0, args.step_time - (time.time() - t_step)))
        ck.wait()


if __name__ == "__main__":
    sys.exit(main())
