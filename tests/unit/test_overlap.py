"""Overlapped saves and slot reservation, in one process on a real tmpfs memory tier.

To hold an overlapped copy back deterministically, some tests queue a blocking job on the
Checkpointer's own copy thread (``ck._save._copier``, one thread, jobs in order): the
save's copy then starts only when the test releases it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierckpt import CheckpointConfig, Checkpointer, IntegrityError, TierckptError
from tierckpt.errors import LoadMismatchWarning, SnapshotChangedError


@pytest.fixture
def cfg(shm_root: Path) -> CheckpointConfig:
    return CheckpointConfig(namespace="ov", memory_dir=str(shm_root))


@pytest.fixture
def ck(cfg: CheckpointConfig) -> Iterator[Checkpointer]:
    with Checkpointer(cfg) as c:
        yield c


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, opt


def _train_step(model: torch.nn.Module) -> None:
    model(torch.randn(16, 64)).tanh().sum().backward()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _clone(sd: dict) -> dict:
    return {k: v.detach().clone() for k, v in sd.items()}


def _hold_copies(ck: Checkpointer) -> threading.Event:
    """Block the copy thread until the returned event is set."""
    gate = threading.Event()
    ck._save._copier.submit(gate.wait)
    return gate


def _load_model(ck: Checkpointer, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int | None, dict]:
    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}, "optim": opt.state_dict()}
    return ck.load(target), target["model"]


def test_optimizer_fence_keeps_the_values_at_the_call(ck: Checkpointer) -> None:
    model, opt = _model()
    ck.register_fence(opt)
    _train_step(model)
    opt.step()  # momentum buffers exist from here on
    opt.zero_grad()
    _train_step(model)
    gate = _hold_copies(ck)
    expected = _clone(model.state_dict())
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    handle = ck.save(1, _state(model, opt), overlap=True)
    assert not handle.staged  # returned before the copy
    # releases the copy later; without the fence, opt.step() below would change the
    # parameters long before the copy reads them
    threading.Timer(0.3, gate.set).start()
    opt.step()  # the step pre-hook waits for the copy
    assert handle.staged
    assert not torch.equal(model[0].weight, expected["0.weight"])  # the step did change them
    handle.wait()
    step, got = _load_model(ck, model, opt)
    assert step == 1
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    # the optimizer state saved is the one at the call too
    out = {"optim": {"state": {i: {"momentum_buffer": torch.zeros_like(m)} for i, m in enumerate(momentum)},
                     "param_groups": opt.state_dict()["param_groups"]}}
    with pytest.warns(LoadMismatchWarning, match="model.0.weight"):  # a partial load, said so
        ck.load(out)
    assert all(torch.equal(out["optim"]["state"][i]["momentum_buffer"], m) for i, m in enumerate(momentum))


def test_training_loop_round_trips_bitwise(ck: Checkpointer) -> None:
    model, opt = _model()
    ck.register_fence(opt)
    snapshots = {}
    for step in range(1, 6):
        _train_step(model)
        snapshots[step] = _clone(model.state_dict())
        ck.save(step, _state(model, opt), overlap=True, check_snapshot=True)
        opt.step()
        opt.zero_grad()
    ck.wait()
    for step in (4, 5):  # memory_steps_retained=2
        target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}, "optim": opt.state_dict()}
        assert ck.load(target, step=step) == step
        assert all(torch.equal(target["model"][k], snapshots[step][k]) for k in snapshots[step])


def test_wait_staged_then_change(ck: Checkpointer) -> None:
    sd = {"w": torch.arange(4096, dtype=torch.float32), "n": 3}
    gate = _hold_copies(ck)
    handle = ck.save(7, sd, overlap=True)
    assert not handle.staged
    gate.set()
    handle.wait_staged(timeout=30)
    assert handle.staged
    sd["w"].zero_()  # allowed now: the copy is done
    sd["n"] = 4  # non-tensor values were copied at the call
    handle.wait()
    out = {"w": torch.zeros(4096), "n": 0}
    assert ck.load(out) == 7
    assert torch.equal(out["w"], torch.arange(4096, dtype=torch.float32)) and out["n"] == 3


def test_explicit_fence_and_later_calls_wait(ck: Checkpointer) -> None:
    sd = {"w": torch.ones(1000)}
    gate = _hold_copies(ck)
    handle = ck.save(1, sd, overlap=True)
    threading.Timer(0.2, gate.set).start()
    ck.fence()
    sd["w"].add_(1)
    ck.save(2, sd)  # a later save waits for the first one's commit
    assert handle.staged and handle.done()
    out = {"w": torch.zeros(1000)}
    assert ck.load(out, step=1) == 1 and torch.equal(out["w"], torch.ones(1000))


def test_debug_mode_names_the_changed_key(ck: Checkpointer) -> None:
    sd = {"a": torch.ones(100), "b": {"c": torch.ones(1000)}}
    gate = _hold_copies(ck)
    handle = ck.save(3, sd, overlap=True, check_snapshot=True)
    sd["b"]["c"][5] = 2.0  # misuse: changed before the fence, not through a fenced optimizer
    gate.set()
    with pytest.raises(SnapshotChangedError, match="'b.c'") as exc:
        handle.wait()
    assert isinstance(exc.value, IntegrityError) and exc.value.key == "b.c" and exc.value.step == 3
    with pytest.raises(SnapshotChangedError):
        handle.wait_staged()
    with pytest.raises(SnapshotChangedError):
        ck.wait()
    assert [s.step for s in ck.steps()] == []  # never committed
    sd["b"]["c"][5] = 1.0
    ck.save(4, sd, overlap=True, check_snapshot=True).wait()  # the checkpointer goes on
    assert [s.step for s in ck.steps()] == [4]


def test_without_debug_mode_the_change_lands_in_the_checkpoint(ck: Checkpointer) -> None:
    """Documents the misuse: no fence, no check, and the checkpoint is not the values at the call."""
    sd = {"w": torch.ones(1000)}
    gate = _hold_copies(ck)
    handle = ck.save(3, sd, overlap=True)
    sd["w"][0] = 9.0
    gate.set()
    handle.wait()
    out = {"w": torch.zeros(1000)}
    ck.load(out)
    assert out["w"][0] == 9.0


def test_copy_failure_surfaces_on_the_handle(ck: Checkpointer) -> None:
    sd = {"w": torch.ones(3), "s": torch.eye(4).to_sparse()}  # a sparse tensor cannot be copied densely
    handle = ck.save(1, sd, overlap=True)
    with pytest.raises(TierckptError, match="'s' cannot be copied") as exc:
        handle.wait()
    assert isinstance(exc.value.__cause__, RuntimeError)
    with pytest.raises(TierckptError):
        ck.wait()
    ck.save(2, {"w": torch.ones(3)}, overlap=True).wait()
    assert [s.step for s in ck.steps()] == [2]


def test_register_fence_on_a_module_and_bad_targets(ck: Checkpointer) -> None:
    bn = torch.nn.BatchNorm1d(8)
    bn(torch.randn(4, 8))
    expected = bn.running_mean.clone()
    ck.register_fence(bn)
    gate = _hold_copies(ck)
    handle = ck.save(1, {"bn": bn.state_dict()}, overlap=True)
    threading.Timer(0.2, gate.set).start()
    bn(torch.randn(4, 8))  # the forward pre-hook waits; then running stats change in place
    assert handle.staged and not torch.equal(bn.running_mean, expected)
    handle.wait()
    out = {"bn": {k: torch.zeros_like(v) for k, v in bn.state_dict().items()}}
    ck.load(out)
    assert torch.equal(out["bn"]["running_mean"], expected)
    removable = ck.register_fence(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0))
    removable.remove()
    with pytest.raises(TierckptError, match="Optimizer or torch.nn.Module"):
        ck.register_fence("optimizer")  # type: ignore[arg-type]


def _slots(shm_root: Path) -> dict[str, os.stat_result]:
    d = shm_root / "ov" / ".slots" / "rank_0"
    return {p.name: p.stat() for p in d.iterdir()}


def _resident_bytes(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path`` (from /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def test_slots_are_reserved_and_faulted_in_before_the_next_saves(ck: Checkpointer, shm_root: Path) -> None:
    sd = {"w": torch.randn(256, 1024), "v": torch.randn(1000)}
    ck.save(1, sd).wait()
    ck._save._reservation.result(timeout=60)  # the reservation the first save started
    slots = _slots(shm_root)
    assert len(slots) == 3  # memory_steps_retained (2) + the one being written
    nbytes = ck.runtime.stager.nbytes_of(sd)
    assert {s.st_size for s in slots.values()} == {nbytes}
    assert all(s.st_blocks * 512 >= nbytes for s in slots.values())  # allocated
    for name in slots:
        assert _resident_bytes(shm_root / "ov" / ".slots" / "rank_0" / name) >= nbytes  # mapped, faulted in
    for step in (2, 3, 4, 5):
        ck.save(step, sd).wait()
    after = _slots(shm_root)
    assert {n: s.st_ino for n, s in after.items()} == {n: s.st_ino for n, s in slots.items()}  # none added


def test_reserve_ahead_of_the_first_save_and_within_the_budget(cfg: CheckpointConfig, shm_root: Path) -> None:
    sd = {"w": torch.randn(128, 1024)}
    with Checkpointer(cfg) as ck:
        nbytes = ck.runtime.stager.nbytes_of(sd)
        assert ck.reserve(sd, wait=True).result() == 3
        slots = _slots(shm_root)
        assert len(slots) == 3 and {s.st_size for s in slots.values()} == {nbytes}
        for name in slots:
            assert _resident_bytes(shm_root / "ov" / ".slots" / "rank_0" / name) >= nbytes  # faulted in
        ck.save(1, sd).wait()
        assert set(_slots(shm_root)) == set(slots)
    with Checkpointer(cfg.replace(namespace="ov2", memory_budget_bytes=2 * nbytes + 100)) as ck:
        assert ck.reserve(sd, wait=True).result() == 2  # a third would break the budget
        assert ck.runtime.pool.held_bytes() <= 2 * nbytes + 100


def test_reservation_resizes_a_freed_slot_of_another_size(ck: Checkpointer, shm_root: Path) -> None:
    small, big = {"w": torch.randn(64, 1024)}, {"w": torch.randn(128, 1024)}
    ck.save(1, small).wait()
    ck._save._reservation.result(timeout=60)
    for step in (2, 3, 4):  # the state grew (as an optimizer's state does after its first step)
        ck.save(step, big).wait()
        ck._save._reservation.result(timeout=60)
    sizes = sorted(s.st_size for s in _slots(shm_root).values())
    assert len(sizes) == 3 and len(set(sizes)) == 1 and sizes[0] == ck.runtime.stager.nbytes_of(big)


def test_torch_still_has_the_one_call_copy() -> None:
    """snapshot uses torch's private ``_foreach_copy_`` (one GIL release per copy) and falls back
    to a per-tensor loop without it; this fails loudly on a torch that dropped or changed it."""
    from tierckpt import snapshot

    assert snapshot._FOREACH_COPY is not None
    dst, src = [torch.zeros(3), torch.zeros(2, 2)], [torch.arange(3.0), torch.ones(2, 2)]
    snapshot._FOREACH_COPY(dst, src)
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))


def test_local_mode_and_durable_copy(shm_root: Path, durable_dir: Path) -> None:
    cfg = CheckpointConfig(namespace="ovl", memory_dir=str(shm_root), durable_url=f"file://{durable_dir}",
                           local_mode=True)
    sd = {"w": torch.arange(1000, dtype=torch.float32), "n": 1}
    with Checkpointer(cfg) as ck:
        gate = _hold_copies(ck)
        handle = ck.save(2, sd, overlap=True, durable=True)
        threading.Timer(0.2, gate.set).start()
        ck.fence()
        sd["w"].zero_()
        handle.wait()
        assert handle.durable
    with Checkpointer(cfg.replace(memory_dir=str(shm_root / "elsewhere"))) as ck:  # memory gone: durable only
        out = {"w": torch.zeros(1000), "n": 0}
        assert ck.load(out) == 2 and ck.last_load["tiers"] == ["durable"]
    assert torch.equal(out["w"], torch.arange(1000, dtype=torch.float32)) and out["n"] == 1
