"""``tierckpt bench data``: the first batch after a restart, against a plain ``DataLoader`` rebuilt.

    tierckpt bench data [--samples 2048] [--sample-kib 64] [--batch-size 32] [--workers 4]
                        [--rounds 5] [--load-s 0.2] [--dir DIR] [--json PATH]

A dataset of ``--samples`` files of ``--sample-kib`` KiB each on disk (``--dir``, default the
system's temporary directory; ``tierckpt.testing.files``: each ``__getitem__`` opens and reads its
file), read in batches of ``--batch-size`` with ``--workers`` worker processes, shuffled. Each round,
back to back, the seconds from the moment the loop wants its first batch to having it:

  plain     a plain ``DataLoader`` built from scratch (what a restarted job does today): construct,
            ``iter`` (the workers fork), ``next``
  rebuilt   a ``tierckpt.data.ResumableLoader`` built from scratch and restored to a position in the
            middle of an epoch (its checkpoint item), ``iter``, ``next``
  ahead     a ``ResumableLoader`` whose workers were started before (``start()``, then ``--load-s``
            seconds of a process group and a state load that its fork overlaps, not timed), restored
            to the position, ``iter``, ``next``: a process restart that builds the loader first
            and repositions it after the load
  prefetch  the same, but repositioned as the load begins (what ``tierckpt.data.item`` does inside
            ``ck.load``: the position is read before the tensors, ``prefetch``), so the workers load
            the position's batches during the ``--load-s``; then ``iter``, ``next``
  standby   a loader a warm standby built before the fault (``tierckpt.data.prewarm``: built
            without a rank, workers forked and warm), bound to the rank (``ahead``), repositioned
            as the load begins, ``--load-s``, ``iter``, ``next``: a process restart under
            ``tierckpt run --warm-loader``
  kept      a ``ResumableLoader`` kept in the process, mid-epoch with its prefetch queues full,
            repositioned to an earlier position than its copies reach (``load_state_dict``),
            ``iter``, ``next``: an in-process restart (``tierckpt.resilient``) that rolls back
            several batches (the workers are reset)
  kept_prefetch  the same, repositioned as the load begins (``ck.load`` does: the workers reset
            and load the position's batches during ``--load-s``), then ``iter``, ``next``
  kept_replay  the same, rolled back by the one batch taken after the saved step (a fault
            between two saves): the batch comes from the copy kept (``replay_batches``)

Every first batch of rebuilt, ahead, prefetch, standby and kept is checked against the batch at that position
(``torch.equal``). Goals (issue 29): an in-process restart <= 0.05 s (kept_replay, kept_prefetch; kept
is the reset without the load's overlap); a warm process restart
(standby) <= 0.2 x plain. Figures are medians.
The files are read through the page cache (written just before, then read once to warm it): the
figures are the loaders' own costs, not the disk's.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from tierckpt.data import ResumableLoader
from tierckpt.data.loader import _AHEAD
from tierckpt.testing.files import write_samples

__all__ = ["main", "run"]

KINDS = ("plain", "rebuilt", "ahead", "prefetch", "standby", "kept", "kept_prefetch", "kept_replay")


class BenchError(RuntimeError):
    """A repositioned loader's first batch is not the batch of its position."""


def _check(batch: Any, want: Any, kind: str) -> None:
    if not (torch.equal(batch[0], want[0]) and torch.equal(batch[1], want[1])):
        raise BenchError(f"{kind}: the first batch after the reposition is not the batch of the position")


def run(directory: Path, *, samples: int, sample_kib: int, batch_size: int, workers: int, rounds: int,
        load_s: float) -> dict[str, Any]:
    features = sample_kib * 256
    # torch's advice on a machine with fewer cores than --workers: the bench asks for them on purpose
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    ds = write_samples(directory, samples, features=features)
    for i in range(len(ds)):  # warm the page cache: the loaders' costs, not the disk's
        ds[i]

    def resumable() -> ResumableLoader:
        return ResumableLoader(ds, batch_size=batch_size, seed=1, rank=0, world_size=1, num_workers=workers)

    # the position: epoch 1, a third of the way in; and the batch there
    probe = resumable()
    probe.sampler.seek(1, base=0, taken=(samples // batch_size // 3) * batch_size)
    position = probe.state_dict()
    reference = ResumableLoader(ds, batch_size=batch_size, seed=1, rank=0, world_size=1)  # no workers
    reference.load_state_dict(position)
    want = next(iter(reference))
    del probe, reference
    kept = resumable()
    kept.load_state_dict(position)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(rounds):
        plain = DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers,
                           generator=torch.Generator().manual_seed(1))
        t0 = time.perf_counter()
        next(iter(plain))
        times["plain"].append(time.perf_counter() - t0)
        del plain
        gc.collect()

        t0 = time.perf_counter()
        rebuilt = resumable()
        rebuilt.load_state_dict(position)
        batch = next(iter(rebuilt))
        times["rebuilt"].append(time.perf_counter() - t0)
        _check(batch, want, "rebuilt")
        del rebuilt, batch
        gc.collect()

        ahead = resumable()
        ahead.start()
        time.sleep(load_s)  # the process group and the state load, which the workers' start overlaps
        t0 = time.perf_counter()
        ahead.load_state_dict(position)
        batch = next(iter(ahead))
        times["ahead"].append(time.perf_counter() - t0)
        _check(batch, want, "ahead")
        del ahead, batch
        gc.collect()

        early = resumable()
        early.start()
        early.load_state_dict(position)  # the position read first, as ck.load does
        early.prefetch()
        time.sleep(load_s)  # the rest of the state loads
        t0 = time.perf_counter()
        batch = next(iter(early))
        times["prefetch"].append(time.perf_counter() - t0)
        _check(batch, want, "prefetch")
        del early, batch
        gc.collect()

        _AHEAD.building = True  # what a warm standby does long before the fault (not timed)
        try:
            built = ResumableLoader(ds, batch_size=batch_size, seed=1, num_workers=workers)
        finally:
            _AHEAD.building = False
        built.start()
        time.sleep(0.5)  # the standby waits for a rank; its workers finished their warm-up
        built.bind(0, 1)  # tierckpt.data.ahead, as the restarted script starts
        built.load_state_dict(position)
        built.prefetch()
        time.sleep(load_s)
        t0 = time.perf_counter()
        batch = next(iter(built))
        times["standby"].append(time.perf_counter() - t0)
        _check(batch, want, "standby")
        del built, batch
        gc.collect()

        it = iter(kept)  # the loop trains on: mid-epoch, the workers' prefetch queues full
        for _ in range(3):
            next(it)
        time.sleep(0.05)
        t0 = time.perf_counter()
        kept.load_state_dict(position)  # the in-process restart rolls back further than the copies kept
        batch = next(iter(kept))
        times["kept"].append(time.perf_counter() - t0)
        _check(batch, want, "kept")
        it = iter(kept)  # and once more, repositioned as ck.load does it: early, the reset during the load
        for _ in range(3):
            next(it)
        time.sleep(0.05)
        kept.load_state_dict(position)
        kept.prefetch()
        time.sleep(load_s)
        t0 = time.perf_counter()
        batch = next(iter(kept))
        times["kept_prefetch"].append(time.perf_counter() - t0)
        _check(batch, want, "kept_prefetch")
        it = iter(kept)
        next(it)
        saved = kept.state_dict()  # a step saved; the next one takes its batch, then the fault
        again = next(it)
        time.sleep(0.05)
        t0 = time.perf_counter()
        kept.load_state_dict(saved)
        batch = next(iter(kept))
        times["kept_replay"].append(time.perf_counter() - t0)
        _check(batch, again, "kept_replay")
        kept.load_state_dict(position)  # back where every round starts
        del it, batch, again
    del kept
    gc.collect()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"samples": samples, "sample_kib": sample_kib, "batch_size": batch_size, "workers": workers,
            "rounds": rounds, "load_s": load_s, "times": times, "median": med,
            "ratio_ahead": med["ahead"] / med["plain"], "ratio_kept": med["kept"] / med["plain"],
            "ratio_prefetch": med["prefetch"] / med["plain"], "ratio_standby": med["standby"] / med["plain"],
            "goal_kept_s": 0.05, "goal_ahead_ratio": 0.2}


def _report(out: dict[str, Any]) -> list[str]:
    m = out["median"]
    rows = [f"first batch after a restart: {out['samples']} files of {out['sample_kib']} KiB, batch "
            f"{out['batch_size']}, {out['workers']} workers, shuffled; median of {out['rounds']} rounds",
            f"  plain DataLoader rebuilt            {m['plain'] * 1e3:8.1f} ms   (anchor)",
            f"  ResumableLoader rebuilt + restored  {m['rebuilt'] * 1e3:8.1f} ms   "
            f"{m['rebuilt'] / m['plain']:.2f} x plain",
            f"  workers started ahead + restored    {m['ahead'] * 1e3:8.1f} ms   "
            f"{out['ratio_ahead']:.2f} x plain",
            f"  started ahead, prefetched in load   {m['prefetch'] * 1e3:8.1f} ms   "
            f"{out['ratio_prefetch']:.3f} x plain",
            f"  warm standby's loader, prefetched   {m['standby'] * 1e3:8.1f} ms   "
            f"{out['ratio_standby']:.3f} x plain (goal <= 0.2 x): "
            + ("PASS" if out["ratio_standby"] <= 0.2 else "MISS"),
            f"  kept, repositioned (in-process)     {m['kept'] * 1e3:8.1f} ms   "
            f"{out['ratio_kept']:.2f} x plain (goal <= 50 ms): " + ("PASS" if m["kept"] <= 0.05 else "MISS"),
            f"  kept, repositioned in the load      {m['kept_prefetch'] * 1e3:8.1f} ms   "
            f"{m['kept_prefetch'] / m['plain']:.3f} x plain (goal <= 50 ms): "
            + ("PASS" if m["kept_prefetch"] <= 0.05 else "MISS"),
            f"  kept, one batch rolled back (copy)  {m['kept_replay'] * 1e3:8.3f} ms   "
            f"{m['kept_replay'] / m['plain']:.4f} x plain (goal <= 50 ms): "
            + ("PASS" if m["kept_replay"] <= 0.05 else "MISS")]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tierckpt bench data", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--sample-kib", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--load-s", type=float, default=0.2, help="the state load the workers' start overlaps (ahead)")
    p.add_argument("--dir", help="where the sample files go (a fresh directory under it, removed after)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if min(args.samples, args.sample_kib, args.batch_size, args.rounds) < 1 or args.workers < 1:
        p.error("--samples, --sample-kib, --batch-size, --rounds and --workers must be >= 1")
    if args.samples < 3 * args.batch_size:
        p.error("--samples must hold at least 3 batches")
    where = Path(tempfile.mkdtemp(prefix="tierckpt-bench-data-", dir=args.dir))
    try:
        out = run(where, samples=args.samples, sample_kib=args.sample_kib, batch_size=args.batch_size,
                  workers=args.workers, rounds=args.rounds, load_s=args.load_s)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    print("\n".join(_report(out)))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
