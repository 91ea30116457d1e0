"""``tierckpt.data``: the data pipeline's position, saved with the model and restored bit for bit.

Real parts: a dataset of files on disk, ``DataLoader`` worker processes (``num_workers=2``), the
``Checkpointer`` on a real tmpfs memory tier. Batches are compared with ``torch.equal``.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler

from tierckpt import CheckpointConfig, Checkpointer, ConfigError, StateDictMismatchError, layout
from tierckpt.data import EpochOrder, ResumableLoader, ResumableSampler, item, loader_state, restore_loader
from tierckpt.errors import LoaderStateMismatchError, ProtocolError, RestartRequested
from tierckpt.testing.files import FileDataset, write_samples

N = 53  # not a multiple of any world size or batch size used: padding and short batches happen


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> FileDataset:
    return write_samples(tmp_path_factory.mktemp("samples"), N)


def _batches(it: Any, n: int) -> list[torch.Tensor]:
    return [torch.cat([x.view(-1), y.to(torch.float32)]) for x, y in itertools.islice(it, n)]


def _stream(loader: ResumableLoader, n: int) -> list[torch.Tensor]:
    """``n`` batches across epochs, as a step-based loop takes them."""
    return _batches(itertools.chain.from_iterable(iter(loader) for _ in itertools.count()), n)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- the order ---------------------------------------------------------------------------
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_a_share_from_the_start_is_distributed_samplers(world: int, shuffle: bool, drop_last: bool) -> None:
    order = EpochOrder(length=N, seed=5, shuffle=shuffle, drop_last=drop_last)
    for epoch in (0, 3):
        for rank in range(world):
            ds = DistributedSampler(range(N), num_replicas=world, rank=rank, shuffle=shuffle, seed=5,
                                    drop_last=drop_last)
            ds.set_epoch(epoch)
            assert order.share(epoch, base=0, world_size=world, rank=rank) == list(ds)
            assert order.share_size(base=0, world_size=world) == len(ds)


@pytest.mark.parametrize(("old", "new"), [(2, 3), (4, 1), (3, 2)])
def test_resharding_continues_the_global_order_without_repeats_or_gaps(old: int, new: int) -> None:
    order = EpochOrder(length=N, seed=1)
    full = order.global_order(2)
    taken = 5  # every rank of the old world took 5 samples
    before = [order.share(2, base=0, world_size=old, rank=r)[:taken] for r in range(old)]
    consumed = order.consumed(base=0, world_size=old, taken=taken)
    assert sorted(i for s in before for i in s) == sorted(full[:consumed])  # a prefix of the order
    after = [order.share(2, base=consumed, world_size=new, rank=r) for r in range(new)]
    rest = [i for s in after for i in s]
    assert set(rest) == set(full[consumed:]) and not set(rest) & set(full[:consumed])


def test_the_sampler_yields_its_share_from_the_position_it_was_sought_to() -> None:
    s = ResumableSampler(EpochOrder(length=N, seed=3), rank=1, world_size=2)
    s.seek(4, base=0, taken=7)
    assert list(s) == EpochOrder(length=N, seed=3).share(4, base=0, world_size=2, rank=1)[7:]
    assert len(s) == 27 - 7
    s.set_epoch(4)  # the epoch it is in: the position stays
    assert len(s) == 20
    s.set_epoch(5)
    assert len(s) == 27
    with pytest.raises(ConfigError, match="rank 2 is not below world_size 2"):
        ResumableSampler(EpochOrder(length=N), rank=2, world_size=2)


# -- the loader counts what the loop consumed, not what its workers prefetched -------------
def test_a_resumed_loader_yields_exactly_the_batches_of_an_uninterrupted_one(files: FileDataset) -> None:
    def make() -> ResumableLoader:
        return ResumableLoader(files, batch_size=4, seed=7, rank=1, world_size=2, num_workers=2)

    want = _stream(make(), 20)  # 27 samples a rank: 7 batches an epoch, so 20 cross two epochs
    first = make()
    got = _stream(first, 9)  # the workers have prefetched past batch 9 by now
    state = loader_state(first)
    assert (state["epoch"], state["taken"]) == (1, 8)  # epoch 0 (7 batches) ran out, 2 of epoch 1
    del first
    second = make()
    restore_loader(second, state)
    got += _stream(second, 11)
    assert _equal(got, want)


def test_a_kept_loader_repositions_without_new_workers(files: FileDataset) -> None:
    loader = ResumableLoader(files, batch_size=4, seed=7, rank=0, world_size=1, num_workers=2)
    it = iter(loader)
    ahead = _batches(it, 3)
    saved = loader.state_dict()
    _batches(it, 4)  # the loop went on, then a restart rolls back to the saved step
    pids = {p.pid for p in loader._loader._iterator._workers}  # type: ignore[union-attr]
    loader.load_state_dict(saved)
    with pytest.raises(ProtocolError, match="repositioned"):
        next(it)  # the old iterator may not deliver past the reposition
    again = _batches(iter(loader), 4)
    assert {p.pid for p in loader._loader._iterator._workers} == pids  # type: ignore[union-attr]
    fresh = ResumableLoader(files, batch_size=4, seed=7, rank=0, world_size=1, num_workers=2)
    assert _equal(ahead + again, _batches(iter(fresh), 7))
    assert loader.rebuilds == 0


def test_a_loader_interrupted_inside_next_is_rebuilt_on_the_next_iter(files: FileDataset) -> None:
    class Interrupting(torch.utils.data.Dataset[Any]):
        """Raises in the main process, inside next(), as tierckpt.resilient's RestartRequested does."""

        armed = False

        def __len__(self) -> int:
            return len(files)

        def __getitem__(self, i: int) -> Any:
            if self.armed:
                self.armed = False
                raise RestartRequested("peer fault")
            return files[i]

    data = Interrupting()
    loader = ResumableLoader(data, batch_size=4, seed=2, rank=0, world_size=1)  # no workers: main process
    it = iter(loader)
    _batches(it, 2)
    saved = loader.state_dict()
    data.armed = True
    with pytest.raises(RestartRequested):
        next(it)
    loader.load_state_dict(saved)
    after = _batches(iter(loader), 2)
    assert loader.rebuilds == 1
    fresh = ResumableLoader(files, batch_size=4, seed=2, rank=0, world_size=1)
    assert _equal(after, _batches(iter(fresh), 4)[2:])


def test_a_mismatched_position_is_a_typed_error(files: FileDataset) -> None:
    loader = ResumableLoader(files, batch_size=4, seed=7, rank=0, world_size=2)
    state = loader.state_dict()
    other = ResumableLoader(files, batch_size=4, seed=8, rank=0, world_size=2)
    with pytest.raises(LoaderStateMismatchError, match="seed=7, this loader seed=8") as err:
        other.load_state_dict(state)
    assert err.value.field == "seed" and isinstance(err.value, StateDictMismatchError)
    with pytest.raises(LoaderStateMismatchError, match="length"):
        ResumableLoader(torch.utils.data.Subset(files, range(10)), batch_size=4, seed=7, rank=0,
                        world_size=2).load_state_dict(state)
    with pytest.raises(LoaderStateMismatchError, match="rank 1 was given rank 0's"):
        ResumableLoader(files, batch_size=4, seed=7, rank=1, world_size=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="rank= and world_size="):
        ResumableLoader(files, batch_size=4)


# -- through the Checkpointer: one item per rank ------------------------------------------
def _cfg(shm_root: Path) -> CheckpointConfig:
    return CheckpointConfig(namespace="data", memory_dir=str(shm_root))


def test_the_checkpointer_restores_the_loader_with_the_model(files: FileDataset, shm_root: Path) -> None:
    def make() -> ResumableLoader:
        return ResumableLoader(files, batch_size=5, seed=11, rank=0, world_size=1, num_workers=2)

    want = _stream(make(), 16)
    loader, w = make(), torch.zeros(3)
    state: dict[str, Any] = {"model": {"w": w}, "data": item(loader)}
    got = []
    with Checkpointer(_cfg(shm_root)) as ck:
        assert ck.load(state) is None
        for step, batch in zip(range(1, 7), itertools.chain.from_iterable(iter(loader) for _ in range(3)),
                               strict=False):
            got += _batches([batch], 1)
            w += step
            ck.save(step, state)
    w2, again = torch.zeros(3), make()
    restored = item(again)
    with Checkpointer(_cfg(shm_root)) as ck:
        assert ck.load({"model": {"w": w2}, "data": restored}) == 6
    assert torch.equal(w2, w) and restored.restored == "exact"
    got += _stream(again, 10)
    assert _equal(got, want)


def test_each_rank_has_its_own_item_and_another_world_reshards(files: FileDataset, shm_root: Path) -> None:
    """The per-rank key is marked in the layout; a world that is not the saving one falls back to
    the world's position. (Across real ranks: tests/multiprocess/test_data_ranks.py.)"""
    loader = ResumableLoader(files, batch_size=4, seed=3, rank=0, world_size=1)
    sd = item(loader).state_dict()
    assert set(sd) == {"position", "__rank0__"} and layout.is_rank_item("data.__rank0__")
    assert not layout.is_rank_item("data.position") and not layout.is_rank_item("x.__rank0__y")
    it = iter(loader)
    _batches(it, 3)
    with Checkpointer(_cfg(shm_root)) as ck:
        ck.save(1, {"data": item(loader)})
    # rank 2 of 3: its key was never saved; it continues from the 12 samples consumed
    wider = ResumableLoader(files, batch_size=4, seed=3, rank=2, world_size=3)
    restored = item(wider)
    with Checkpointer(_cfg(shm_root)) as ck:
        assert ck.load({"data": restored}, strict=True) == 1
    assert restored.restored == "resharded"
    assert list(wider.sampler) == EpochOrder(length=N, seed=3).share(0, base=12, world_size=3, rank=2)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_a_stateful_dataloader_round_trips_through_its_item(files: FileDataset, shm_root: Path) -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make() -> Any:
        return sdl.StatefulDataLoader(files, batch_size=4, shuffle=True, num_workers=2,
                                      generator=torch.Generator().manual_seed(9))

    want = _batches(iter(make()), 10)
    loader = make()
    it = iter(loader)
    got = _batches(it, 4)
    with Checkpointer(_cfg(shm_root)) as ck:
        ck.save(4, {"data": item(loader, rank=0, world_size=1)})
    del it
    again = make()
    with Checkpointer(_cfg(shm_root)) as ck:
        assert ck.load({"data": item(again, rank=0, world_size=1)}) == 4
    got += _batches(iter(again), 6)
    assert _equal(got, want)
    with Checkpointer(_cfg(shm_root)) as ck, pytest.raises(LoaderStateMismatchError, match="only a tierckpt.data"):
        ck.load({"data": item(make(), rank=0, world_size=2)})


def test_workers_started_ahead_are_kept_and_serve_the_loaded_position(files: FileDataset) -> None:
    loader = ResumableLoader(files, batch_size=4, seed=7, rank=0, world_size=2, num_workers=2)
    loader.start()  # they warm up on the batches of epoch 0, which the loop never sees
    it = loader._loader._iterator  # type: ignore[union-attr]
    assert it is not None and len(it._workers) == 2
    pids = {p.pid for p in it._workers}
    loader.load_state_dict({**loader.state_dict(), "epoch": 2, "taken": 8})
    got = _batches(iter(loader), 3)
    assert {p.pid for p in loader._loader._iterator._workers} == pids  # type: ignore[union-attr]
    share = EpochOrder(length=N, seed=7).share(2, base=0, world_size=2, rank=0)[8:20]
    assert _equal(got, _batches(iter(torch.utils.data.DataLoader(torch.utils.data.Subset(files, share),
                                                                 batch_size=4)), 3))


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_the_readmes_three_lines_run_and_resume(files: FileDataset, shm_root: Path) -> None:
    """README's "The data pipeline resumes too": at most three lines, and they work as written."""
    import tierckpt
    import tierckpt.data

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## The data pipeline resumes too"):]
    code = section.split("```python\n", 1)[1].split("\n```", 1)[0]
    assert len(code.splitlines()) <= 3 and '"data": tierckpt.data.item(loader)' in code

    def run(steps: int) -> tuple[int | None, list[torch.Tensor], torch.nn.Linear]:
        model = torch.nn.Linear(32, 8)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []
        with Checkpointer(_cfg(shm_root)) as ck:
            scope: dict[str, Any] = {"tierckpt": tierckpt, "dataset": files, "model": model, "optim": optim,
                                     "ck": ck, "torch": torch}
            torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
            try:
                exec(code, scope)
            finally:
                torch.distributed.destroy_process_group()
            start = scope["start"]
            batches = itertools.chain.from_iterable(iter(scope["loader"]) for _ in itertools.count())
            for step in range(0 if start is None else start + 1, steps):
                x, y = next(batches)
                seen.append(y)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optim.step()
                optim.zero_grad()
                ck.save(step, scope["state_dict"])
        return start, seen, model

    first = run(2)
    again = run(5)
    assert first[0] is None and again[0] == 1
    fresh = ResumableLoader(files, batch_size=32, seed=0, rank=0, world_size=1)
    want = [y for _, y in itertools.islice(itertools.chain.from_iterable(iter(fresh) for _ in range(3)), 5)]
    assert _equal(first[1] + again[1], want)


def test_a_short_rollback_replays_copies_and_leaves_the_workers_alone(files: FileDataset) -> None:
    loader = ResumableLoader(files, batch_size=4, seed=7, rank=0, world_size=1, num_workers=2, replay_batches=2)
    want = _batches(iter(ResumableLoader(files, batch_size=4, seed=7, rank=0, world_size=1)), 8)
    it = iter(loader)
    got = _batches(it, 3)
    saved = loader.state_dict()  # step 3 saved
    x, _ = next(it)  # step 4 takes its batch, then a NaN: the loop changed the batch in place first
    x.mul_(0)
    live = loader._live
    received = loader._loader._iterator._rcvd_idx  # type: ignore[union-attr]
    loader.load_state_dict(saved)
    again = iter(loader)
    got += _batches(again, 1)
    assert loader._live is live and loader._loader._iterator._rcvd_idx == received  # type: ignore[union-attr]
    got += _batches(again, 4)  # then the live iterator goes on
    assert _equal(got, want) and loader.rebuilds == 0
    assert loader.state_dict()["taken"] == 32
    # further back than the copies: the workers are reset, the batches still right
    loader.load_state_dict(saved)
    assert _equal(_batches(iter(loader), 5), want[3:8])
