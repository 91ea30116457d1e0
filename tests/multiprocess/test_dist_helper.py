"""The rank runner itself: results in rank order, failures and hangs end the call."""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers.dist import RankFailed, RankTimeout, run_alone, run_ranks


def _identity(rank: int, tag: str) -> tuple:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return (rank, dist.get_world_size(), int(t), tag, os.getpid())


def _one_fails_other_blocks(rank: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise RuntimeError("rank 1 broke")
    dist.broadcast(torch.zeros(1), src=1)  # waits for rank 1 forever


def _hangs(rank: int) -> None:
    time.sleep(600)


def test_results_come_back_in_rank_order():
    out = run_ranks(_identity, 3, "x")
    assert [o[:4] for o in out] == [(0, 3, 6, "x"), (1, 3, 6, "x"), (2, 3, 6, "x")]
    assert len({o[4] for o in out} | {os.getpid()}) == 4  # each rank is its own process
    assert run_alone(len, "four") == 4


def test_a_failing_rank_ends_the_call_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 broke"):
        run_ranks(_one_fails_other_blocks, 2, timeout=60)
    assert time.monotonic() - t0 < 30  # the blocked rank was not waited for


def test_a_hanging_rank_is_killed_at_the_deadline():
    t0 = time.monotonic()
    with pytest.raises(RankTimeout):
        run_ranks(_hangs, 2, timeout=3)
    assert time.monotonic() - t0 < 20
