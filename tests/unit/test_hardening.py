"""Issue 10's hardening items: every failure typed and named, budgets that say what works,
private torch names guarded, background bugs kept apart from faults."""

from __future__ import annotations

import ast
import datetime
import logging
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tierckpt
from tierckpt import CheckpointConfig, Checkpointer, MemoryBudgetError, TierckptError
from tierckpt.errors import CheckpointFailedError, ProtocolError, UnsaveableObjectError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SRC = Path(tierckpt.__file__).resolve().parent


@pytest.fixture
def cfg(shm_root: Path) -> CheckpointConfig:
    return CheckpointConfig(namespace="hard", memory_dir=str(shm_root), durable_url=None)


def state(v: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((64, 32), v)}, "epoch": int(v)}


def committed(shm_root: Path, ns: str = "hard") -> list[str]:
    return sorted(p.parent.name for p in (shm_root / ns).glob("step_*/COMMITTED"))


# -- objects that cannot be saved -----------------------------------------------------------
@pytest.mark.parametrize(
    ("bad", "cause"),
    [(threading.Lock(), TypeError), (lambda: 1, Exception)],
    ids=["lock", "lambda"],
)
def test_unsaveable_value_is_reported_by_save_naming_key_step_and_tier(
    cfg: CheckpointConfig, shm_root: Path, bad: Any, cause: type[BaseException]
) -> None:
    with Checkpointer(cfg) as ck:
        ck.save(1, state(1)).result()
        sd = state(2)
        sd["extra"] = {"hooks": [bad]}
        with pytest.raises(UnsaveableObjectError) as info:
            ck.save(2, sd)  # raised by save() itself, not by the handle
        err = info.value
        assert err.key == "extra.hooks" and err.step == 2 and err.tier == "memory"
        assert "'extra.hooks'" in str(err) and "step 2" in str(err)
        assert isinstance(err.__cause__, cause) and isinstance(err, TypeError)
        ck.wait()
        assert committed(shm_root) == ["step_1"]  # nothing of step 2 was committed
        ck.save(3, state(3)).result()  # the checkpointer stays usable
        with pytest.raises(UnsaveableObjectError) as info:  # a list with tensors: DCP flattens it
            ck.save(4, {"model": {"w": torch.ones(2)}, "buffers": [torch.ones(1), bad]})
        assert info.value.key == "buffers.1"
    assert committed(shm_root) == ["step_1", "step_3"]


class _TorchSaveRefuses:
    """Pickles with pickle's newest protocol (the check) but not with torch.save's protocol 2."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        if protocol == 2:
            raise RuntimeError("no protocol 2 for me")
        return (_TorchSaveRefuses, ())


def test_failure_inside_dcp_reaches_the_handle_as_a_catchable_tierckpt_error(cfg: CheckpointConfig) -> None:
    with Checkpointer(cfg) as ck:
        handle = ck.save(4, {"w": torch.ones(8), "odd": _TorchSaveRefuses()})
        try:
            handle.result(timeout=60)
        except Exception as exc:  # a training loop's handler: CheckpointException would escape it
            err = exc
        else:
            pytest.fail("the save should have failed")
        assert isinstance(err, TierckptError) and err.step == 4
        assert not isinstance(err, CheckpointException)
        chain = [err]
        while chain[-1].__cause__ is not None:
            chain.append(chain[-1].__cause__)  # type: ignore[arg-type]
        assert any(isinstance(e, RuntimeError) and "no protocol 2" in str(e) for e in chain), chain
        with pytest.raises(TierckptError):
            ck.wait()


def test_checkpoint_exception_from_dcp_becomes_checkpoint_failed_error() -> None:
    from tierckpt import guard

    inner = ValueError("planner broke")
    wrapped = guard.typed(CheckpointException("x", {0: (inner, None), 1: (KeyError("k"), None)}), step=9, tier="durable")
    assert isinstance(wrapped, CheckpointFailedError) and isinstance(wrapped, Exception)
    assert wrapped.__cause__ is inner and wrapped.step == 9 and wrapped.tier == "durable"
    assert set(wrapped.failures) == {0, 1} and "rank 0: ValueError: planner broke" in str(wrapped)
    ours = tierckpt.IntegrityError("bad copy")
    assert guard.typed(CheckpointException("x", {1: ours}), step=3) is ours and ours.step == 3
    interrupt = KeyboardInterrupt()
    assert guard.typed(interrupt) is interrupt


# -- the memory budget ------------------------------------------------------------------------
def test_budget_between_one_and_two_steps_fails_at_once_with_a_fix_that_works(cfg: CheckpointConfig) -> None:
    with Checkpointer(cfg.replace(memory_steps_retained=1)) as probe:
        probe.save(0, state(0)).result()
        # one step's slot, record headers included: the step's data file is a link to its slot
        # (the pool may already hold more slots, reserved ahead of the next saves)
        nbytes = (Path(cfg.memory_dir) / cfg.namespace / "step_0" / "__0_0.distcp").stat().st_size
    tight = cfg.replace(namespace="tight", memory_steps_retained=1, memory_budget_bytes=nbytes * 3 // 2)
    with Checkpointer(tight) as ck:
        with pytest.raises(MemoryBudgetError) as info:
            ck.save(5, state(5))
        assert info.value.step == 5 and info.value.tier == "memory"
        assert f"set memory_budget_bytes to at least {2 * nbytes}" in str(info.value)
    fixed = tight.replace(namespace="fixed", memory_budget_bytes=2 * nbytes)  # the fix it names
    with Checkpointer(fixed) as ck:
        for s in range(1, 5):
            ck.save(s, state(s)).result()
        out = state(0)
        assert ck.load(out) == 4 and torch.equal(out["model"]["w"], state(4)["model"]["w"])


def test_two_slot_budget_holds_with_durable_copies_in_flight(shm_root: Path, durable_dir: Path) -> None:
    """A durable copy pins the slot of the step it reads; the next saves wait for it, not fail."""
    big = {"w": torch.randn(4096, 1024)}  # 16 MiB: the drain to disk outlasts the next copy
    cfg = CheckpointConfig(namespace="pinned", memory_dir=str(shm_root), durable_url=f"file://{durable_dir}",
                           memory_steps_retained=1, durable_every_n_steps=1)
    with Checkpointer(cfg) as probe:
        probe.save(0, big).result()
        nbytes = probe.runtime.pool.held_bytes()
    with Checkpointer(cfg.replace(namespace="pinned2", memory_budget_bytes=2 * nbytes)) as ck:
        handles = [ck.save(s, big) for s in range(1, 7)]
        for h in handles:
            h.result(timeout=120)
        assert ck.runtime.pool.held_bytes() <= 2 * nbytes
        out = {"w": torch.zeros(4096, 1024)}
        assert ck.load(out) == 6 and torch.equal(out["w"], big["w"])
    assert sorted(p.parent.name for p in (durable_dir / "pinned2").glob("step_*/COMMITTED")) == [
        f"step_{s}" for s in range(1, 7)
    ]


# -- private torch names -------------------------------------------------------------------------
def test_private_torch_names_are_checked_and_the_torch_is_one_we_checked() -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from tierckpt import _torch_compat

    _torch_compat.check()
    major_minor = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    newest = tuple(int(p) for p in _torch_compat.TESTED[1].split("."))
    assert major_minor <= newest, (
        f"torch {torch.__version__} is newer than {_torch_compat.TESTED[1]}, the newest torch whose private "
        "DCP names tierckpt checked: read _torch_compat.py's list against this torch, then raise TESTED"
    )
    assert FileSystemReader.__module__ == _torch_compat.StorageInfo.__module__  # plain DCP's own class
    nested = {"a": {"b": torch.ones(1), "c": [torch.zeros(1), torch.ones(2)]}, "n": 3, "s": {"t": "x"}}
    flat, mapping = _torch_compat.flatten_state_dict(nested)
    fb_flat, fb_mapping = _torch_compat._fallback_flatten(nested)
    assert list(flat) == list(fb_flat) and mapping == fb_mapping
    assert all(flat[k] is fb_flat[k] for k in flat)
    assert _torch_compat.ShardedTensor is not None and _torch_compat._sharded_from_shards is not None


def test_sharded_like_keeps_the_global_metadata_and_says_where_each_copy_is() -> None:
    """A staged ShardedTensor: the original's global metadata, the copies as local shards; a copy on
    another device than its placement (a CUDA shard's host copy; here meta → cpu) names its own."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard
    from torch.distributed._shard.sharded_tensor.api import ShardedTensorBase
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    from tierckpt import _torch_compat

    spec = ChunkShardingSpec(dim=0, placements=["rank:0/meta", "rank:1/meta"])
    metadata = spec.build_metadata(torch.Size([4, 3]), TensorProperties(dtype=torch.bfloat16))
    local = Shard(torch.empty(2, 3, dtype=torch.bfloat16, device="meta"), metadata.shards_metadata[0])
    original = ShardedTensorBase._init_from_local_shards_and_global_metadata([local], metadata, sharding_spec=spec)
    copy = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    staged = _torch_compat.sharded_like(original, [copy])
    assert _torch_compat.is_sharded_tensor(staged) and not _torch_compat.is_sharded_tensor(copy)
    assert staged.metadata() == original.metadata() and staged.sharding_spec() == spec
    [shard] = staged.local_shards()
    assert shard.tensor is copy
    assert shard.metadata == ShardMetadata([0, 0], [2, 3], "rank:0/cpu")
    assert [str(m.placement) for m in staged.metadata().shards_metadata] == ["rank:0/meta", "rank:1/meta"]


def test_no_assert_statements_in_library_code() -> None:
    """``assert`` vanishes under ``python -O``: runtime checks anywhere in the package raise typed errors."""
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 50
    found = [f"{f.relative_to(SRC)}:{node.lineno}" for f in files
             for node in ast.walk(ast.parse(f.read_text())) if isinstance(node, ast.Assert)]
    assert found == []


# -- the node-commit waiter ---------------------------------------------------------------------
@pytest.fixture
def one_rank_group() -> Any:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _wait_for(thread_name: str) -> None:
    for t in threading.enumerate():
        if t.name == thread_name:
            t.join(timeout=30)
            assert not t.is_alive()


def test_node_commit_waiter_keeps_bugs_apart_from_faults(
    cfg: CheckpointConfig, one_rank_group: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A real c10d store; the bug is injected by replacing the tier's commit (no other way to have one)."""
    from tierckpt.dcp import node_commit
    from tierckpt.observability import StepLogger
    from tierckpt.runtime import RankRuntime

    rt = RankRuntime(cfg, 0)
    log = StepLogger("test", 0)
    try:
        # a fault: nobody publishes in time; a warning, nothing kept for the next save
        monkeypatch.setattr(node_commit, "WAIT_S", 0.2)
        with caplog.at_level(logging.WARNING):
            node_commit.await_publication(rt, 1, "save-a", log)
            _wait_for("tierckpt-node-commit-1")
        assert rt.background_errors == [] and "was not committed" in caplog.text
        node_commit.raise_background_error(rt, 2)  # nothing to raise

        # a bug: kept, and raised by the next save as a ProtocolError chained to it
        def broken_commit(*args: Any, **kwargs: Any) -> None:
            raise AttributeError("'NoneType' object has no attribute 'write'")

        monkeypatch.setattr(node_commit, "WAIT_S", 30.0)
        monkeypatch.setattr(rt.memory, "commit", broken_commit)
        monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the test reads it instead
        # published first: one process shares one store connection, which a waiting thread holds
        node_commit.publish(rt, 3, "save-b", b"md", b"mf", log)
        node_commit.await_publication(rt, 3, "save-b", log)
        _wait_for("tierckpt-node-commit-3")
        assert len(rt.background_errors) == 1
        with pytest.raises(ProtocolError, match="AttributeError") as info:
            node_commit.raise_background_error(rt, 4)
        assert isinstance(info.value.__cause__, AttributeError) and info.value.step == 4
        assert rt.background_errors == []
    finally:
        rt.close()


def test_writer_without_a_step_fails_before_collectives_in_a_process_group(
    cfg: CheckpointConfig, one_rank_group: Any
) -> None:
    with pytest.raises(tierckpt.ConfigError, match="no step for this save"):
        dcp.save(state(1), storage_writer=tierckpt.TieredStorageWriter(cfg))


# -- background failures keep their cause -----------------------------------------------------------
def test_durable_failures_keep_their_cause(shm_root: Path, durable_dir: Path) -> None:
    (durable_dir / "hard").write_text("a file where the namespace directory should be")
    cfg = CheckpointConfig(namespace="hard", memory_dir=str(shm_root), durable_url=f"file://{durable_dir}")
    with Checkpointer(cfg) as ck:  # the background drain
        with pytest.raises(tierckpt.DurableWriteError) as info:
            ck.save(1, state(1)).result(timeout=60)
        assert isinstance(info.value.__cause__, OSError), info.value.__cause__
        with pytest.raises(tierckpt.DurableWriteError):
            ck.wait()
    writer = tierckpt.TieredStorageWriter(cfg.replace(namespace="hard"), step=2, durable=True)
    with pytest.raises(CheckpointException) as wrapped:  # plain dcp.save: the writer's finish
        dcp.save(state(2), storage_writer=writer)
    (failure,) = [f[0] if isinstance(f, tuple) else f for f in wrapped.value.failures.values()]
    assert isinstance(failure, tierckpt.DurableWriteError) and isinstance(failure.__cause__, OSError)
