"""The loader's position across real gloo ranks (global mode): one item per rank, resharding.

Two ranks read a dataset of files through ``ResumableLoader`` and save their position with a model
tensor at step 4; the step holds one item per rank (not deduplicated into one). Two new ranks
resume exactly the batches an uninterrupted pair would have seen next; three new ranks continue
the epoch's global order from the samples consumed: no sample consumed comes again, none left is
skipped. (The ranks are daemonic processes, which may not have children: no loader workers here;
tests/unit/test_data.py and the soak run them.)
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierckpt
from tests.helpers.dist import run_ranks
from tierckpt.data import EpochOrder, ResumableLoader, item
from tierckpt.testing.files import FileDataset, write_samples

pytestmark = pytest.mark.slow

N, BATCH, SEED, STEP = 41, 3, 4, 4


def _cfg(memory_dir: str) -> tierckpt.CheckpointConfig:
    return tierckpt.CheckpointConfig(namespace="data-ranks", memory_dir=memory_dir)


def _labels(loader: ResumableLoader, n: int) -> list[list[float]]:
    """``n`` batches as lists of each sample's first feature (a sample's identity in these files)."""
    stream = itertools.chain.from_iterable(iter(loader) for _ in itertools.count())
    return [x[:, 0].tolist() for x, _ in itertools.islice(stream, n)]


def _uninterrupted(rank: int, files: str) -> list[list[float]]:
    return _labels(ResumableLoader(FileDataset(files), batch_size=BATCH, seed=SEED), 12)


def _save(rank: int, files: str, memory_dir: str) -> list[list[float]]:
    loader = ResumableLoader(FileDataset(files), batch_size=BATCH, seed=SEED)
    got = _labels(loader, STEP)
    with tierckpt.Checkpointer(_cfg(memory_dir)) as ck:
        ck.save(STEP, {"w": torch.arange(4.0), "data": item(loader)})  # w: replicated, as a DDP model
    return got


def _resume(rank: int, files: str, memory_dir: str, n: int) -> dict[str, Any]:
    loader = ResumableLoader(FileDataset(files), batch_size=BATCH, seed=SEED)
    restored, w = item(loader), torch.zeros(4)
    with tierckpt.Checkpointer(_cfg(memory_dir)) as ck:
        step = ck.load({"w": w, "data": restored}, strict=True)  # strict: the other ranks' items are no "unloaded keys"
    return {"step": step, "w": w.tolist(), "how": restored.restored, "base": loader.sampler.base, "epoch": loader.epoch,
            "indices": list(loader.sampler), "batches": _labels(loader, n)}


def test_each_rank_resumes_its_own_batches_and_a_new_world_reshards(tmp_path: Path, shm: Any) -> None:
    files = str(tmp_path / "samples")
    ds = write_samples(files, N)
    first = [ds[i][0][0].item() for i in range(N)]  # the first feature names a sample
    mem = shm("data")
    want = run_ranks(_uninterrupted, 2, files, timeout=120)
    got = run_ranks(_save, 2, files, mem, timeout=120)
    meta = dcp.FileSystemReader(str(Path(mem) / "data-ranks" / f"step_{STEP}")).read_metadata()
    keys = set(meta.state_dict_metadata)
    assert {"data.__rank0__", "data.__rank1__", "data.position"} <= keys, keys

    again = run_ranks(_resume, 2, files, mem, 12 - STEP, timeout=120)
    for rank in (0, 1):
        assert again[rank]["step"] == STEP and again[rank]["how"] == "exact" and again[rank]["w"] == [0.0, 1.0, 2.0, 3.0]
        assert got[rank] + again[rank]["batches"] == want[rank], rank

    wider = run_ranks(_resume, 3, files, mem, 1, timeout=120)
    consumed = EpochOrder(length=N, seed=SEED).consumed(base=0, world_size=2, taken=STEP * BATCH)
    order = EpochOrder(length=N, seed=SEED).global_order(0)
    assert consumed == 24 and all(w["how"] == "resharded" and w["base"] == 24 and w["epoch"] == 0 for w in wider)
    rest = sorted(i for w in wider for i in w["indices"])
    assert set(rest) == set(order[24:]) and len(rest) == 18  # 17 left, padded to 18 (DistributedSampler's)
    seen = {v for r in (0, 1) for b in got[r] for v in b}
    assert seen == {first[i] for i in order[:24]}
    assert not seen & {v for w in wider for b in w["batches"] for v in b}
