"""Two gloo ranks on loopback, each its own 'node' (memory root), draining to one S3 bucket; then the
nodes are lost and both ranks restore the same step from S3 alone."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

from tests.helpers.dist import run_ranks
from tests.helpers.state import assert_state_equal, small_state, to_wire, zeros_like_state

pytestmark = [pytest.mark.s3, pytest.mark.slow]


def _config(memory_dir: str, url: str) -> Any:
    from tierckpt import CheckpointConfig, S3Settings

    return CheckpointConfig(
        namespace="tworanks", memory_dir=memory_dir, durable_url=url,
        s3=S3Settings(part_size=5 * 2**20, max_concurrency=4, max_attempts=4, retry_deadline_s=30),
    )


def _save(rank: int, env: dict[str, str], memory_dirs: list[str], url: str) -> list[int]:
    import torch

    from tierckpt import Checkpointer

    os.environ.update(env)  # the standard AWS variables, as a launcher would pass them
    with Checkpointer(_config(memory_dirs[rank], url)) as ck:
        for step in (1, 2):
            state = small_state(step, rank)
            state[f"big{rank}"] = torch.full((2 * 2**20,), float(rank * 10 + step))  # 8 MiB, rank-private
            ck.save(step, state, durable=True)
        ck.wait()
        durable = ck.runtime.durable
        assert durable is not None
        return [s.step for s in durable.list_steps()]


def _load(rank: int, env: dict[str, str], memory_dirs: list[str], url: str) -> Any:
    import torch

    from tierckpt import Checkpointer

    os.environ.update(env)
    with Checkpointer(_config(memory_dirs[rank], url)) as ck:
        target = zeros_like_state(small_state(0, rank))
        target[f"big{rank}"] = torch.zeros(2 * 2**20)
        step = ck.load(target)
        return step, ck.last_load["tiers"], to_wire(target)


def test_two_ranks_save_to_s3_and_restore_from_s3_after_losing_both_nodes(
    s3_env: dict[str, str], bucket: str, shm_factory: Any
) -> None:
    import torch

    from tests.helpers.state import from_wire

    url = f"s3://{bucket}/multi"
    nodes = [shm_factory("rank0"), shm_factory("rank1")]
    assert run_ranks(_save, 2, s3_env, nodes, url, timeout=150) == [[1, 2], [1, 2]]
    for node in nodes:
        shutil.rmtree(node)
    fresh = [shm_factory("new0"), shm_factory("new1")]
    results = run_ranks(_load, 2, s3_env, fresh, url, timeout=150)
    for rank, (step, tiers, wire) in enumerate(results):
        assert step == 2 and tiers == ["durable"]
        got = from_wire(wire)
        big = got.pop(f"big{rank}")
        assert torch.equal(big, torch.full((2 * 2**20,), float(rank * 10 + 2)))
        assert_state_equal(got, small_state(2, rank))
