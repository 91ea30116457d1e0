"""The methods the local benchmark times, each on one rank: warm-ups, then ``repeats`` timed runs.

Every method gets the same ``Rank`` (its state dict, a preallocated load target, a scratch
directory on /dev/shm shared by the ranks) and records into a ``Recorder``: per figure
("copy", "save", "blocking", "load") the seconds and the peak extra anonymous RSS of each
timed run (warm-up times are kept apart). One warm-up each, two for tierckpt's saves (its
slot ring fills on the first two). Every load is checked bitwise against the state it came from before the next
run; a difference raises ``VerificationError`` on every rank at the same point, so the
ranks stay in step and the run goes on with the next method. Each method removes its files
when done (after a failure, the run's directory goes at exit).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import tierckpt
from tierckpt.bench.measure import (
    RssProbe,
    VerificationError,
    check_equal,
    local_tensors,
    rss_anon,
    trim_heap,
)

__all__ = ["METHODS", "Rank", "Recorder", "leak_check"]


@dataclass
class Rank:
    """What one rank benchmarks with. ``expected``/``got``: local tensors of ``state``/``target``."""

    rank: int
    world_size: int
    state: dict[str, Any]
    target: dict[str, Any]
    root: Path
    repeats: int
    expected: list[torch.Tensor] = field(init=False)
    got: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        self.expected = local_tensors(self.state)
        self.got = local_tensors(self.target)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def fresh_dir(self, name: str) -> Path:
        """An empty ``root/name`` seen by every rank (rank 0 makes it; untimed)."""
        path = self.root / name
        self.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        self.barrier()
        return path

    def remove(self, name: str) -> None:
        self.barrier()
        if self.rank == 0:
            shutil.rmtree(self.root / name, ignore_errors=True)
        self.barrier()

    def verify(self, what: str, got: list[torch.Tensor] | None = None, problem: str | None = None) -> None:
        """Raise VerificationError on every rank if any rank's round trip differs (ranks stay in step)."""
        if problem is None:
            try:
                check_equal(self.expected, self.got if got is None else got, what)
            except VerificationError as exc:
                problem = str(exc)
        problems: list[Any] = [problem]
        if self.world_size > 1:
            problems = [None] * self.world_size
            dist.all_gather_object(problems, problem)
        failed = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
        if failed:
            raise VerificationError("; ".join(failed))

    def zero_target(self) -> None:
        for t in self.got:
            t.zero_()

    def timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, RssProbe, Any]:
        """Seconds, peak extra anonymous RSS and result of ``fn(...)``, all ranks starting together."""
        self.barrier()
        with RssProbe() as probe:
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            seconds = time.perf_counter() - t0
        return seconds, probe, result

    def runs(self, warmups: int = 1) -> range:
        """Run indices: negative ones are warm-ups, kept apart by ``Recorder.add``."""
        return range(-warmups, self.repeats)


@dataclass
class Recorder:
    """One method on one rank: figure → {"s", "rss", "rss_source", "warmup_s": [...]}; checks."""

    figures: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)

    def add(self, run: int, figure: str, seconds: float, probe: RssProbe | None) -> None:
        entry = self.figures.setdefault(figure, {"s": [], "rss": [], "rss_source": [], "warmup_s": []})
        if run < 0:
            entry["warmup_s"].append(seconds)
            return
        entry["s"].append(seconds)
        entry["rss"].append(None if probe is None else probe.extra)
        entry["rss_source"].append(None if probe is None else probe.source)


def memcpy_torch(ctx: Rank, rec: Recorder) -> None:
    """``copy_`` into the preallocated load target, torch's default threads."""
    for run in ctx.runs():
        s, probe, _ = ctx.timed(_copy_all, ctx.got, ctx.expected)
        ctx.verify("torch copy_")
        rec.add(run, "copy", s, probe)


def memcpy_numpy(ctx: Rank, rec: Recorder) -> None:
    """``np.copyto`` into the preallocated load target, one thread."""
    src = [t.numpy() for t in ctx.expected]
    dst = [t.numpy() for t in ctx.got]
    for run in ctx.runs():
        s, probe, _ = ctx.timed(_copyto_all, dst, src)
        ctx.verify("np.copyto")
        rec.add(run, "copy", s, probe)


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, x in zip(dst, src, strict=True):
        d.copy_(x)


def _copyto_all(dst: list[np.ndarray[Any, Any]], src: list[np.ndarray[Any, Any]]) -> None:
    for d, x in zip(dst, src, strict=True):
        np.copyto(d, x)


def torch_save(ctx: Rank, rec: Recorder) -> None:
    """``torch.save`` of this rank's local tensors to /dev/shm; ``torch.load(weights_only=True)``."""
    path = ctx.fresh_dir("torch_save") / f"rank{ctx.rank}.pt"
    local = {f"t{i:03d}": t for i, t in enumerate(ctx.expected)}
    for run in ctx.runs():
        path.unlink(missing_ok=True)  # a fresh file each time, as a training job writes
        s, probe, _ = ctx.timed(torch.save, local, path)
        rec.add(run, "save", s, probe)
        s, probe, loaded = ctx.timed(torch.load, path, weights_only=True)
        ctx.verify("torch.load", [loaded[k] for k in sorted(local)])
        del loaded
        rec.add(run, "load", s, probe)
    ctx.remove("torch_save")


def dcp_fs(ctx: Rank, rec: Recorder) -> None:
    """DCP ``FileSystemWriter`` / ``FileSystemReader`` on /dev/shm, default options."""
    for run in ctx.runs():
        _dcp_round(ctx, rec, run, ctx.fresh_dir("dcp_fs"), "save", "load")
    ctx.remove("dcp_fs")


def _dcp_round(ctx: Rank, rec: Recorder, run: int, path: Path, save_fig: str, load_fig: str) -> None:
    """DCP ``FileSystemWriter`` save into ``path``, then a checked ``FileSystemReader`` load."""
    s, probe, _ = ctx.timed(dcp_save, ctx.state, storage_writer=FileSystemWriter(path))
    rec.add(run, save_fig, s, probe)
    ctx.zero_target()
    s, probe, _ = ctx.timed(dcp_load, ctx.target, storage_reader=FileSystemReader(path))
    ctx.verify("DCP FileSystemReader")
    rec.add(run, load_fig, s, probe)


def dcp_async(ctx: Rank, rec: Recorder) -> None:
    """DCP ``async_save`` (thread executor) with a ``FileSystemWriter``: blocking time and total."""
    path = ctx.root
    for run in ctx.runs():
        path = ctx.fresh_dir("dcp_async")
        ctx.barrier()
        with RssProbe() as probe:
            t0 = time.perf_counter()
            response: Any = dcp_async_save(ctx.state, storage_writer=FileSystemWriter(path))
            t1 = time.perf_counter()
            # a Future, or an AsyncSaveResponse when the writer stages asynchronously
            getattr(response, "upload_completion", response).result()
            t2 = time.perf_counter()
        rec.add(run, "blocking", t1 - t0, probe)
        rec.add(run, "save", t2 - t0, probe)
    ctx.zero_target()
    dcp_load(ctx.target, storage_reader=FileSystemReader(path))
    ctx.verify("DCP async_save, loaded back")
    ctx.remove("dcp_async")


# With one step retained, tierckpt's slots form a ring of two: the first two saves each
# allocate a slot (tmpfs pages), later ones reuse them. Both allocating saves are warm-ups.
_SLOT_WARMUPS = 2


def tierckpt_save(ctx: Rank, rec: Recorder) -> None:
    """``Checkpointer.save`` (blocking: the call; save: until ``result()``) and ``Checkpointer.load``."""
    cfg = tierckpt.CheckpointConfig(
        namespace="bench", memory_dir=str(ctx.fresh_dir("tierckpt")), memory_steps_retained=1
    )
    step = 0
    with tierckpt.Checkpointer(cfg) as ck:
        for run in ctx.runs(_SLOT_WARMUPS):
            step += 1
            with RssProbe() as probe:
                blocking, total, handle = _timed_save(ctx, ck, step)
            rec.add(run, "blocking", blocking, probe)
            rec.add(run, "save", total, probe)
            rec.add(run, "blocking_reported", handle.blocking_s, None)
            ctx.zero_target()
            s, probe, loaded = ctx.timed(ck.load, ctx.target)
            wrong_step = None if loaded == step else f"Checkpointer.load returned step {loaded}, expected {step}"
            ctx.verify("Checkpointer.load", problem=wrong_step)
            rec.add(run, "load", s, probe)
            rec.add(run, "load_reported", float(ck.last_load["seconds"]), None)
        rec.checks["snapshot"] = _snapshot_holds(ctx, ck, step + 1)
    ctx.remove("tierckpt")


def _timed_save(ctx: Rank, ck: tierckpt.Checkpointer, step: int) -> tuple[float, float, Any]:
    """Seconds the ``save`` call blocked, seconds until its ``result()``, and the handle."""
    ctx.barrier()
    t0 = time.perf_counter()
    handle = ck.save(step, ctx.state)
    t1 = time.perf_counter()
    handle.result()
    return t1 - t0, time.perf_counter() - t0, handle


def _snapshot_holds(ctx: Rank, ck: tierckpt.Checkpointer, step: int) -> bool:
    """Mutate the state right after ``save`` returns; the step must still hold the old values."""
    firsts = [t.view(-1)[0].item() for t in ctx.expected]
    handle = ck.save(step, ctx.state)
    for t in ctx.expected:
        t.view(-1)[0] = -1.0  # the state holds values >= 0 only
    handle.result()
    for t, v in zip(ctx.expected, firsts, strict=True):
        t.view(-1)[0] = v
    ctx.zero_target()
    ck.load(ctx.target)
    return all(torch.equal(a, b) for a, b in zip(ctx.expected, ctx.got, strict=True))


def tierckpt_dcp(ctx: Rank, rec: Recorder) -> None:
    """``dcp.save`` / ``dcp.load`` with tierckpt's ``TieredStorageWriter`` / ``TieredStorageReader``."""
    cfg = tierckpt.CheckpointConfig(
        namespace="bench-dcp", memory_dir=str(ctx.fresh_dir("tierckpt_dcp")), memory_steps_retained=1
    )
    for step, run in enumerate(ctx.runs(_SLOT_WARMUPS), start=1):
        writer = tierckpt.TieredStorageWriter(cfg, step=step)
        s, probe, _ = ctx.timed(dcp_save, ctx.state, storage_writer=writer)
        rec.add(run, "save", s, probe)
        ctx.zero_target()
        s, probe, _ = ctx.timed(dcp_load, ctx.target, storage_reader=tierckpt.TieredStorageReader(cfg))
        ctx.verify("dcp.load with TieredStorageReader")
        rec.add(run, "load", s, probe)
    ctx.remove("tierckpt_dcp")


def leak_check(ctx: Rank, state: dict[str, Any], saves: int) -> dict[str, list[int]]:
    """``saves`` consecutive saves of ``state``, anonymous RSS after each (free heap trimmed first).

    "tierckpt": ``Checkpointer.save`` + ``result()``; "dcp_fs": DCP FileSystemWriter saves, the
    reference for what DCP's own planning and collectives leave behind per save.
    """
    cfg = tierckpt.CheckpointConfig(
        namespace="bench-leak", memory_dir=str(ctx.fresh_dir("leak")), memory_steps_retained=1
    )
    series: dict[str, list[int]] = {"tierckpt": [], "dcp_fs": []}
    with tierckpt.Checkpointer(cfg) as ck:
        for step in range(1, saves + 1):
            ck.save(step, state).result()
            series["tierckpt"].append(_settled_anon())
    ctx.remove("leak")
    for _ in range(saves):
        path = ctx.fresh_dir("leak")
        dcp_save(state, storage_writer=FileSystemWriter(path))
        series["dcp_fs"].append(_settled_anon())
    ctx.remove("leak")
    return series


def _settled_anon() -> int:
    """Anonymous RSS once free heap pages went back to the kernel: what is still allocated."""
    trim_heap()
    return rss_anon()


def paired(ctx: Rank, rec: Recorder) -> None:
    """Rounds that time the anchors and tierckpt back to back, for ratios under the same load.

    On a shared machine the load changes from minute to minute, so figures taken minutes
    apart (the methods above run one after the other) can differ by 2x for reasons that have
    nothing to do with the code. Each round here times, in a row: torch ``copy_`` of the
    state into preallocated memory, ``Checkpointer.save`` (the call, then until ``result()``),
    ``Checkpointer.load``, DCP ``FileSystemWriter`` and DCP ``FileSystemReader``; the goals
    take the median of the per-round ratios.
    """
    cfg = tierckpt.CheckpointConfig(
        namespace="paired", memory_dir=str(ctx.fresh_dir("paired")), memory_steps_retained=1
    )
    step = 0
    with tierckpt.Checkpointer(cfg) as ck:
        for run in ctx.runs(_SLOT_WARMUPS):
            s, probe, _ = ctx.timed(_copy_all, ctx.got, ctx.expected)
            rec.add(run, "copy", s, probe)
            step += 1
            with RssProbe() as probe:
                blocking, total, _ = _timed_save(ctx, ck, step)
            rec.add(run, "blocking", blocking, probe)
            rec.add(run, "save", total, probe)
            ctx.zero_target()
            s, probe, loaded = ctx.timed(ck.load, ctx.target)
            ctx.verify("paired Checkpointer.load", problem=None if loaded == step else f"loaded step {loaded}")
            rec.add(run, "load", s, probe)
            # a fresh directory each round, as dcp_fs does
            _dcp_round(ctx, rec, run, ctx.fresh_dir("paired_dcp"), "dcp_save", "dcp_load")
    ctx.remove("paired")
    ctx.remove("paired_dcp")


# in run order; the plug-in goes last: its process-wide runtime keeps slots mapped until exit
METHODS: dict[str, Callable[[Rank, Recorder], None]] = {
    "memcpy_numpy": memcpy_numpy,
    "memcpy_torch": memcpy_torch,
    "torch_save": torch_save,
    "dcp_fs": dcp_fs,
    "dcp_async": dcp_async,
    "tierckpt": tierckpt_save,
    "tierckpt_dcp": tierckpt_dcp,
    "paired": paired,
}
