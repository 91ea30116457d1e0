"""A dead rank replaced alone under ``tierckpt run``: 2 agents x 1 worker under ``tierckpt.resilient``,
gloo on 127.0.0.1, real SIGKILL.

The survivor keeps its process (same pid) and restarts in-process; the dead rank's agent starts
one replacement (new pid) that joins the survivor's next in-process generation; nobody is
stopped, and the job ends with the same parameters, bit for bit, as a run without the fault.
Rank 0 (whose process hosted the in-process store before the agent hosted it) is killed too,
a replacement is killed right after it joined, and a job not under the wrapper still gets the
process restart.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.launcher.cluster import LocalJob
from tests.launcher.conftest import shm_dirs

pytestmark = pytest.mark.slow

STEPS = 40
TRAIN = ["--steps", str(STEPS), "--step-time", "0.1"]


def _final_digests(job: LocalJob) -> dict[int, str]:
    return {r: next(e["digest"] for e in reversed(job.trace(r)) if e["event"] == "step" and e["step"] == STEPS)
            for r in (0, 1)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[int, str]]]:
    """Final parameter digests of fault-free runs, per flavour (computed once, on first use)."""
    class Lazy(dict[str, dict[int, str]]):
        def __missing__(self, flavour: str) -> dict[int, str]:
            extra = ["--inprocess"] if flavour == "inprocess" else []
            job = LocalJob(tmp_path_factory.mktemp(f"ref-{flavour}"), shm, train=[*TRAIN, *extra])
            try:
                job.start()
                assert job.wait_exit(240) == {0: 0, 1: 0}, job.report()
                self[flavour] = _final_digests(job)  # kept: the next test of the flavour reuses it
            finally:
                job.close()
            return self[flavour]

    with shm_dirs("tierckpt-ref") as shm:
        yield Lazy()


def _pids(job: LocalJob, rank: int) -> list[int]:
    seen: list[int] = []
    for e in job.trace(rank):
        if e["pid"] not in seen:
            seen.append(e["pid"])
    return seen


def _kill_when_stepping(job: LocalJob, rank: int, after: int = 8) -> int:
    job.wait_for(lambda: min(job.last_step(0), job.last_step(1)) >= after, 150, f"both ranks reach step {after}")
    victim = job.worker_pid(rank)
    os.kill(victim, signal.SIGKILL)
    return victim


def _restarts(job: LocalJob, node: int) -> list[dict[str, Any]]:
    return [e for e in job.events(node) if e["event"] == "restart"]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("victim_rank", [1, 0])
def test_a_killed_rank_is_replaced_alone_and_the_survivor_stays(make_job: Callable[..., LocalJob], victim_rank: int,
                                                                reference: dict[str, dict[int, str]]) -> None:
    job = make_job(train=[*TRAIN, "--inprocess"])
    job.start()
    survivor_rank = 1 - victim_rank
    victim = _kill_when_stepping(job, victim_rank)
    survivor = job.worker_pid(survivor_rank)
    assert job.wait_exit(200) == {0: 0, 1: 0}, job.report()
    assert _pids(job, survivor_rank) == [survivor], "the survivor's process must stay"
    pids = _pids(job, victim_rank)
    assert len(pids) == 2 and pids[0] == victim and pids[1] != victim, pids
    for node in (0, 1):
        assert not any(e["event"] == "stopped" for e in job.events(node)), "no process may be stopped"
        restarts = _restarts(job, node)
        assert [e["kind"] for e in restarts] == ["replace"], job.report()
        assert restarts[0]["reason"] == "Crash" and restarts[0]["recovery_s"] > 0
    mine = _restarts(job, victim_rank)[0]  # node n runs rank n
    assert mine["rank"] == victim_rank and mine["pid"] == pids[1], mine
    fault = next(e for e in job.events(victim_rank) if e["event"] == "fault")
    assert fault["reason"] == "Crash" and fault["kind"] == "replace" and fault["rank"] == victim_rank
    assert fault["node"] == victim_rank  # node n runs rank n
    joined = [e for e in job.trace(victim_rank) if e["event"] == "pg" and e["pid"] == pids[1]]
    assert joined and joined[0]["inproc"] >= 1 and joined[0]["reason"] == "Crash", joined
    back = [e for e in job.trace(survivor_rank) if e["event"] == "pg" and e.get("inproc") == joined[0]["inproc"]]
    assert back and back[0]["reason"] == "Crash", "the survivor is told the cause, not its own connection error"
    assert _final_digests(job) == reference["inprocess"], "the state must equal a fault-free run's, bit for bit"


@pytest.mark.timeout(420)
def test_a_replacement_killed_right_after_it_joined_converges_or_fails_with_a_reason(
        make_job: Callable[..., LocalJob], reference: dict[str, dict[int, str]]) -> None:
    job = make_job(train=[*TRAIN, "--inprocess"])
    job.start()
    first = _kill_when_stepping(job, 1)
    second = job.wait_for(lambda: job.worker_pid(1) != first and job.worker_pid(1), 120, "a replacement joins")
    os.kill(second, signal.SIGKILL)
    codes = job.wait_exit(300)  # bounded: never a hang
    exits = [e for e in job.events() if e["event"] == "exit"]
    if codes == {0: 0, 1: 0}:
        assert _final_digests(job) == reference["inprocess"], "converged: bit for bit"
        faults = [e for e in job.events(1) if e["event"] == "fault"]
        assert len(faults) >= 2 and all((f["reason"], f["node"]) == ("Crash", 1) for f in faults[:2]), job.report()
    else:
        assert any(str(e.get("why", "")).startswith(("CrashLoop", "NoProgress", "--max-restarts")) for e in exits), job.report()


@pytest.mark.timeout(420)
def test_a_job_not_under_the_wrapper_still_restarts_its_processes(make_job: Callable[..., LocalJob],
                                                                  reference: dict[str, dict[int, str]]) -> None:
    job = make_job(train=TRAIN)
    job.start()
    _kill_when_stepping(job, 1)
    survivor = job.worker_pid(0)
    assert job.wait_exit(200) == {0: 0, 1: 0}, job.report()
    for node in (0, 1):
        assert [e["kind"] for e in _restarts(job, node)] == ["process"], job.report()
        assert any(e["event"] == "stopped" for e in job.events(node))
        assert "kind" not in next(e for e in job.events(node) if e["event"] == "fault")
    assert len(_pids(job, 0)) == 2 and _pids(job, 0)[0] == survivor, "every process restarts"
    assert _final_digests(job) == reference["plain"]

