"""A rank replaced alone (kill -9, a fresh process joins the survivor's next generation) keeps saving.

Issue 24, item 1: under ``tierckpt.resilient`` the survivor keeps its interpreter across a
generation while the replacement is a fresh process. Both build a new ``Checkpointer`` on
the new process group. Every save after that failed on both ranks with ``KeyError:
'DefaultSavePlanner'``: DCP's plan cache lives in class attributes keyed by the planner's
class name, so the survivor still held the previous generation's plans and the replacement
had none. Here real gloo processes play it through at the Checkpointer level, for a
replaced non-coordinator and a replaced coordinator: the saves of the new generation must
commit, and fresh processes must load them bitwise.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.dist import run_ranks, start_alone
from tests.helpers.state import assert_state_equal, from_wire, small_state, to_wire, zeros_like_state

NS = "replaced"
GENERATIONS = {0: [1, 2, 3], 1: [4, 5, 6]}  # the steps each generation saves

pytestmark = pytest.mark.slow


def _member(port: int, memory_dir: str, rank: int, generations: list[int], out: str, die: bool) -> None:
    """Take part in ``generations`` as ``rank``, one Checkpointer each; then SIGKILL itself when ``die``.

    Each generation's outcome (the steps committed, or the save failure) goes to ``out``.
    """
    import torch.distributed as dist

    import tierckpt

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    report: dict[str, Any] = {}
    for k in generations:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{k}", store), rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        cfg = tierckpt.CheckpointConfig(namespace=NS, memory_dir=memory_dir, memory_steps_retained=8)
        try:
            with tierckpt.Checkpointer(cfg) as ck:
                for step in GENERATIONS[k]:
                    ck.save(step, small_state(step, rank))
                ck.wait()
                report[str(k)] = {"ok": [s.step for s in ck.steps()]}
        except BaseException as exc:  # noqa: B036 - the parent asserts on it
            report[str(k)] = {"error": f"{type(exc).__name__}: {exc}"}
        store.set(f"gen{k}/left/{rank}", "1")  # every rank leaves k before the victim dies
        store.wait([f"gen{k}/left/{r}" for r in (0, 1)])
        dist.destroy_process_group()
        Path(out).write_text(json.dumps(report))
    if die:
        os.kill(os.getpid(), signal.SIGKILL)


def _load(rank: int, memory_dir: str, step: int) -> Any:
    import tierckpt

    sd = zeros_like_state(small_state(0, rank))
    with tierckpt.Checkpointer(tierckpt.CheckpointConfig(namespace=NS, memory_dir=memory_dir)) as ck:
        got = ck.load(sd, step=step)
    return got, to_wire(sd)


def _join(proc: Any, timeout: float) -> int:
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
        raise AssertionError(f"process {proc.pid} did not finish within {timeout:.0f}s; killed")
    return int(proc.exitcode)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", [1, 0], ids=["non-coordinator", "coordinator"])
def test_saves_commit_after_one_rank_is_replaced(tmp_path: Path, shm: Any, victim: int) -> None:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60),  # type: ignore[attr-defined]
                           wait_for_workers=False)
    memory = shm()
    out = {name: str(tmp_path / f"{name}.json") for name in ("survivor", "victim", "replacement")}
    survivor_rank = 1 - victim
    survivor = start_alone(_member, server.port, memory, survivor_rank, [0, 1], out["survivor"], False)
    first = start_alone(_member, server.port, memory, victim, [0], out["victim"], True)
    procs = [survivor, first]
    try:
        assert _join(first, 120) == -signal.SIGKILL
        replacement = start_alone(_member, server.port, memory, victim, [1], out["replacement"], False)
        procs.append(replacement)
        assert _join(replacement, 120) == 0
        assert _join(survivor, 30) == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    reports = {name: json.loads(Path(path).read_text()) for name, path in out.items()}
    assert reports["victim"]["0"] == {"ok": [1, 2, 3]}
    assert reports["survivor"]["0"] == {"ok": [1, 2, 3]}
    # the generation after the replacement: every save commits on both ranks
    assert reports["survivor"]["1"] == {"ok": [1, 2, 3, 4, 5, 6]}, reports
    assert reports["replacement"]["1"] == {"ok": [1, 2, 3, 4, 5, 6]}, reports
    for step in (4, 6):
        for rank, (got, wire) in enumerate(run_ranks(_load, 2, memory, step)):
            assert got == step
            assert_state_equal(from_wire(wire), small_state(step, rank))


def _one_rank_changes(rank: int, memory_dir: str) -> list[int]:
    import tierckpt

    cfg = tierckpt.CheckpointConfig(namespace=NS, memory_dir=memory_dir, memory_steps_retained=8)
    with tierckpt.Checkpointer(cfg) as ck:
        for step in (1, 2, 3):
            sd = small_state(step, rank)
            if rank == 1 and step >= 2:  # only rank 1's plan changes at step 2
                sd["late"] = small_state(step, rank)["model"]["w"] + 1
            ck.save(step, sd)
        ck.wait()
        return [s.step for s in ck.steps()]


def _load_changed(rank: int, memory_dir: str, step: int) -> Any:
    import tierckpt

    sd = zeros_like_state(small_state(step, rank))
    if rank == 1:
        sd["late"] = zeros_like_state(small_state(step, rank)["model"]["w"])
    with tierckpt.Checkpointer(tierckpt.CheckpointConfig(namespace=NS, memory_dir=memory_dir)) as ck:
        return ck.load(sd, step=step), to_wire(sd)


@pytest.mark.timeout(120)
def test_a_save_where_one_rank_replans_commits(shm: Any) -> None:
    """Only rank 1's plan changes: every rank takes the new plan, and the step loads bitwise."""
    memory = shm()
    assert run_ranks(_one_rank_changes, 2, memory) == [[1, 2, 3], [1, 2, 3]]
    for step in (2, 3):
        for rank, (got, wire) in enumerate(run_ranks(_load_changed, 2, memory, step)):
            want = small_state(step, rank)
            if rank == 1:
                want["late"] = want["model"]["w"] + 1
            assert got == step
            assert_state_equal(from_wire(wire), want)
