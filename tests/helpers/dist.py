"""Run a test function in real processes: N gloo ranks on loopback, or one lone process.

    results = run_ranks(fn, 2, arg1, arg2, timeout=60)   # fn(rank, arg1, arg2) on 2 ranks
    value = run_alone(fn, arg1)                          # fn(arg1) in one fresh process
    proc = start_alone(fn, arg1)                         # a process to kill -9 yourself

Every call starts fresh processes, so each sees only what a restarted job would: the
files. Processes fork from a forkserver that imported torch once (an import costs ~4 s on
the 2-core machine). Ranks meet through a TCPStore the parent owns on a free port, so
there is no port race. A call can never hang: past ``timeout`` every process it started
is killed (SIGKILL) and the call raises ``RankTimeout``; when a rank fails the others are
killed after a short grace and the call raises ``RankFailed`` with every traceback.
``fn`` and its arguments must be picklable (a module-level function).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RankFailed", "RankTimeout", "run_alone", "run_ranks", "start_alone"]

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "tierckpt",
]
_GRACE_S = 5.0


class RankFailed(AssertionError):
    """A rank raised, or died without reporting (killed, crashed)."""


class RankTimeout(AssertionError):
    """The ranks did not finish before the deadline; they were killed."""


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # only takes effect before the server starts
    return ctx


def _rank_main(conn: Any, fn: Callable[..., Any], rank: int, world_size: int, port: int | None,
               timeout: float, args: tuple[Any, ...]) -> None:
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a SIGSEGV / SIGBUS in a rank prints its Python stack
    try:
        if port is not None:
            store = dist.TCPStore(
                "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout)
            )
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
            result = fn(rank, *args)
        else:
            result = fn(*args)
        conn.send(("ok", result))
    except BaseException:  # noqa: B036 - report everything to the parent, then exit
        conn.send(("error", traceback.format_exc()))
    finally:
        if port is not None and dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def _run(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], *, timeout: float,
         distributed: bool) -> list[Any]:
    ctx = _context()
    store = None
    port = None
    if distributed:
        import torch.distributed as dist

        store = dist.TCPStore(
            "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        port = store.port
    procs, conns = [], []
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_rank_main, name=f"rank{rank}",
                args=(child_end, fn, rank, world_size, port, timeout, args), daemon=True,
            )
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        return _collect(procs, conns, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        for c in conns:
            c.close()
        del store


def _collect(procs: list[Any], conns: list[Any], timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    pending = set(range(len(procs)))
    first_error_at: float | None = None
    while pending:
        now = time.monotonic()
        limit = deadline if first_error_at is None else min(deadline, first_error_at + _GRACE_S)
        if now >= limit:
            break
        ready = multiprocessing.connection.wait(
            [conns[r] for r in pending] + [procs[r].sentinel for r in pending], limit - now
        )
        for r in sorted(pending):
            if conns[r] in ready or (procs[r].sentinel in ready and conns[r].poll()):
                try:
                    status, value = conns[r].recv()
                except EOFError:
                    procs[r].join(5)
                    status, value = "error", f"died without a result (exit code {procs[r].exitcode})"
                if status == "ok":
                    results[r] = value
                else:
                    errors[r] = value
                pending.discard(r)
            elif procs[r].sentinel in ready:
                procs[r].join()
                errors[r] = f"died without a result (exit code {procs[r].exitcode})"
                pending.discard(r)
            if r in errors and first_error_at is None:
                first_error_at = time.monotonic()
    if errors:
        detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        if pending:
            detail += f"\n--- ranks {sorted(pending)} were still running and were killed ---"
        raise RankFailed(f"{len(errors)} rank(s) failed:\n{detail}")
    if pending:
        raise RankTimeout(
            f"ranks {sorted(pending)} of {len(procs)} did not finish within {timeout:.0f}s; killed"
        )
    return [results[r] for r in range(len(procs))]


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90.0) -> list[Any]:
    """``fn(rank, *args)`` on ``world_size`` fresh gloo ranks; their results in rank order."""
    return _run(fn, world_size, args, timeout=timeout, distributed=True)


def run_alone(fn: Callable[..., Any], *args: Any, timeout: float = 90.0) -> Any:
    """``fn(*args)`` in one fresh process with no process group; its result."""
    return _run(fn, 1, args, timeout=timeout, distributed=False)[0]


def start_alone(fn: Callable[..., Any], *args: Any) -> Any:
    """Start ``fn(*args)`` in a fresh process and return it (a ``Process``; kill it yourself).

    The caller must ``kill()`` and ``join()`` it; ``pid`` is its operating-system id.
    """
    ctx = _context()
    p = ctx.Process(target=_lone_main, args=(fn, args), daemon=True)
    p.start()
    return p


def _lone_main(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    fn(*args)


