"""The first batch at once after a process restart (issue 29): the loader's position is applied
before the model's tensors load and its workers prefetch meanwhile; a loader built ahead of its
rank (a warm standby's, ``tierckpt.data.prewarm``) is taken and bound by the script.

Real parts: sample files on disk, ``DataLoader`` worker processes, the ``Checkpointer`` on a real
tmpfs memory tier; batches compared with ``torch.equal``. The standby itself is not started here
(``tests/unit/launcher/test_warm_loader.py`` runs one): ``prewarm.build`` is what it calls.
"""

from __future__ import annotations

import itertools
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import CheckpointConfig, Checkpointer, ConfigError
from tierckpt.data import ResumableLoader, ahead, item, prewarm
from tierckpt.loading import EarlyPlanner
from tierckpt.testing.files import FileDataset, write_samples

N = 53


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> FileDataset:
    return write_samples(tmp_path_factory.mktemp("samples"), N)


def _batches(it: Any, n: int) -> list[torch.Tensor]:
    return [torch.cat([x.view(-1), y.to(torch.float32)]) for x, y in itertools.islice(it, n)]


def _stream(loader: ResumableLoader, n: int) -> list[torch.Tensor]:
    return _batches(itertools.chain.from_iterable(iter(loader) for _ in itertools.count()), n)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("local_mode", [False, True], ids=["global", "local"])
def test_the_position_loads_before_the_tensors_and_the_workers_prefetch_meanwhile(
        files: FileDataset, shm_root: Path, monkeypatch: pytest.MonkeyPatch, local_mode: bool) -> None:
    def make() -> ResumableLoader:
        return ResumableLoader(files, batch_size=4, seed=5, rank=0, world_size=1, num_workers=2)

    want = _stream(make(), 14)
    loader = make()
    model = {f"w{i}": torch.full((64,), float(i)) for i in range(8)}
    got = _stream_until_saved(loader, model, shm_root, saves=4, local_mode=local_mode)
    again = make()
    again.start()  # a restarted process: workers forked ahead, before the load
    pids = again.worker_pids()
    assert len(pids) == 2
    data = item(again)
    seen: list[tuple[bool, bool]] = []  # (loader repositioned, its workers asked) at each tensor's arrival
    commit = EarlyPlanner.commit_tensor

    def watch(self: EarlyPlanner, read_item: Any, tensor: torch.Tensor) -> None:
        seen.append((data.early, again._pending is not None and again._live is not None))
        commit(self, read_item, tensor)

    monkeypatch.setattr(EarlyPlanner, "commit_tensor", watch)
    fresh = {k: torch.zeros(64) for k in model}
    with Checkpointer(CheckpointConfig(namespace="early", memory_dir=str(shm_root), local_mode=local_mode)) as ck:
        assert ck.load({"model": fresh, "data": data}) == 4
    assert len(seen) == len(model) and all(e and p for e, p in seen), seen
    assert data.early and data.prefetched == "early" and data.restored == "exact"
    assert all(torch.equal(fresh[k], model[k]) for k in model)
    assert again.worker_pids() == pids  # prefetched by the workers started ahead, none forked by the load
    got += _stream(again, 14 - len(got))
    assert _equal(got, want)


def _stream_until_saved(loader: ResumableLoader, model: dict[str, torch.Tensor], shm_root: Path, *,
                        saves: int, local_mode: bool = False) -> list[torch.Tensor]:
    got = []
    with Checkpointer(CheckpointConfig(namespace="early", memory_dir=str(shm_root), local_mode=local_mode)) as ck:
        stream = itertools.chain.from_iterable(iter(loader) for _ in itertools.count())
        for step in range(1, saves + 1):
            got += _batches(stream, 1)
            for t in model.values():
                t += step
            ck.save(step, {"model": model, "data": item(loader)})
    return got


def test_a_load_without_workers_running_forks_them_at_the_end_and_prefetches(files: FileDataset,
                                                                             shm_root: Path) -> None:
    loader = ResumableLoader(files, batch_size=4, seed=5, rank=0, world_size=1, num_workers=2)
    _stream_until_saved(loader, {"w": torch.zeros(4)}, shm_root, saves=2)
    cold = ResumableLoader(files, batch_size=4, seed=5, rank=0, world_size=1, num_workers=2)
    data = item(cold)
    with Checkpointer(CheckpointConfig(namespace="early", memory_dir=str(shm_root))) as ck:
        assert ck.load({"model": {"w": torch.zeros(4)}, "data": data}) == 2
    assert data.early  # repositioned before the tensors, but no worker ran: none is forked from the reading thread
    assert data.prefetched == "at the end" and len(cold.worker_pids()) == 2  # forked at the end, asked at once


# -- built ahead of the rank (what a warm standby does) ----------------------------------
FACTORY = """
    import sys
    from tierckpt.data import ResumableLoader
    from tierckpt.testing.files import FileDataset

    def make_loader(rank, world_size):
        root = sys.argv[sys.argv.index("--data") + 1]  # the script's own arguments
        return ResumableLoader(FileDataset(root), batch_size=3, seed=2, rank=rank, world_size=world_size,
                               num_workers=2)

    def per_rank(rank, world_size):
        shard = f"{sys.argv[2]}/shard-{rank % world_size}"  # a dataset of this rank's own: needs the rank
        return ResumableLoader(FileDataset(shard), batch_size=3, rank=rank, world_size=world_size)

    def bound(rank, world_size):
        return ResumableLoader(FileDataset(sys.argv[2]), batch_size=3, rank=0, world_size=1)
"""


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    (tmp_path / "prewarm_factories.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    import prewarm_factories  # type: ignore[import-not-found]

    yield prewarm_factories
    prewarm.discard()
    sys.modules.pop("prewarm_factories", None)


def test_a_loader_built_ahead_is_bound_to_its_rank_and_serves_the_same_batches(
        files: FileDataset, factories: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["train.py", "--data", str(files.directory)]
    assert prewarm.build(["prewarm_factories:make_loader"], argv=argv) == []
    pids = prewarm.worker_pids()
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(sys, "argv", argv)
    loader = ahead(factories.make_loader)
    report = prewarm.last()
    assert report is not None and report.warm and sorted(report.worker_pids) == sorted(pids)
    assert (loader.rank, loader.world_size) == (1, 2) and loader.bound
    cold = factories.make_loader(1, 2)
    assert _equal(_stream(loader, 2 * len(cold) + 3), _stream(cold, 2 * len(cold) + 3))  # across epochs
    assert sorted(loader.worker_pids()) == sorted(pids)  # the standby's workers served them
    again = ahead(factories.make_loader, rank=0, world_size=2)  # taken once: a second call builds anew
    report = prewarm.last()
    assert report is not None and not report.warm and "no warm standby" in report.why
    assert set(again.worker_pids()).isdisjoint(pids)


def test_a_factory_that_needs_the_rank_is_built_cold_by_the_script(files: FileDataset, factories: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    problems = prewarm.build(["prewarm_factories:per_rank", "prewarm_factories:bound", "prewarm_factories:nope"],
                             argv=["train.py", "--data", str(files.directory)])
    assert len(problems) == 3, problems
    assert "per_rank: TypeError" in problems[0], problems[0]
    assert "bound to a rank" in problems[1] and "AttributeError" in problems[2]
    assert prewarm.worker_pids() == []
    with pytest.raises(ConfigError, match="RANK"):
        ahead(factories.make_loader)  # no rank given, none in the environment
    monkeypatch.setattr(sys, "argv", ["train.py", "--data", str(files.directory)])
    ahead(factories.make_loader, rank=0, world_size=1)
    report = prewarm.last()
    assert report is not None and not report.warm and "could not build it: prewarm_factories:per_rank" in report.why


@pytest.mark.parametrize("spec", ["train", "train:", ":f", "a-b:f", "train:make loader"])
def test_a_bad_warm_loader_spec_is_a_config_error(spec: str) -> None:
    with pytest.raises(ConfigError, match="MODULE:FUNCTION"):
        prewarm.parse_spec(spec)


def test_a_loader_built_ahead_refuses_to_iterate_before_it_is_bound(files: FileDataset) -> None:
    from tierckpt.data.loader import _AHEAD

    _AHEAD.building = True
    try:
        loader = ResumableLoader(files, batch_size=4)
    finally:
        _AHEAD.building = False
    assert not loader.bound
    with pytest.raises(ConfigError, match="built ahead of its rank"):
        iter(loader)
    loader.bind(2, 3)
    assert len(_batches(iter(loader), 2)) == 2
