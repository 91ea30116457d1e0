"""Lost nodes under ``tierckpt run`` on real processes (2 agents x 1 worker, gloo on 127.0.0.1).

- a node lost and relaunched gets its old group rank back (torch alone orders a round by pid,
  so the relaunched node would take the survivor's rank and each memory tier would hold the
  other rank's files), and training resumes from the newest step with the weights of the
  fault-free trajectory, bit for bit;
- with no durable tier, 2 nodes replicate by default: the README's configuration (global mode,
  memory tier only) recovers from a worker's SIGKILL and from a lost node;
- SIGKILL of the ``tierckpt run`` process alone: its reaper claims ``LostNode`` and stops its
  workers within a second; the relaunched node resumes from its peer's replica.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.launcher.cluster import LocalJob, alive, newest_replica, replica_steps
from tests.launcher.conftest import shm_dirs

pytestmark = pytest.mark.slow

RANKS = (0, 1)
STEPS = 60


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, dict[int, str]]]:
    """rank -> step -> parameter digest of the same training without a fault (the reference)."""
    yield from reference_digests(tmp_path_factory, STEPS, timeout=180)


def reference_digests(tmp_path_factory: pytest.TempPathFactory, steps: int, *,
                      timeout: float) -> Iterator[dict[int, dict[int, str]]]:
    """The demo trained ``steps`` steps on 2 nodes without a fault: rank -> step -> parameter digest."""
    with shm_dirs("tierckpt-run-ref") as shm:
        job = LocalJob(tmp_path_factory.mktemp("reference"), shm, train=["--steps", str(steps)],
                       run_args=["--replicas", "0"])
        try:
            job.start()
            assert job.wait_exit(timeout) == {0: 0, 1: 0}, job.report()
            yield {r: steps_of(job, r)[0] for r in RANKS}
        finally:
            job.close()


def steps_of(job: LocalJob, rank: int) -> dict[int, dict[int, str]]:
    """generation -> step -> parameter digest, as the rank's trace recorded them."""
    out: dict[int, dict[int, str]] = {}
    for e in job.trace(rank):
        if e["event"] == "step":
            out.setdefault(e["generation"], {})[e["step"]] = e["digest"]
    return out


def assert_resumed_on_trajectory(job: LocalJob, gen: int, reference: dict[int, dict[int, str]], *,
                                 at_least: int, complete: bool = True, steps: int = STEPS,
                                 available: int | None = None) -> int:
    """Both ranks resumed generation ``gen`` from the same step (the newest both saved, >= ``at_least``;
    ``available``: the newest step a rank's surviving tiers still held, when its own memory was lost), with
    the weights saved at that step, and every step trained since equals the fault-free run's, bit for bit."""
    resumed = {r: job.resumed(r, gen) for r in RANKS}
    assert all(v is not None and v["step"] is not None for v in resumed.values()), (resumed, job.report())
    step = resumed[0]["step"]
    assert resumed[1]["step"] == step and step >= at_least, resumed
    # the newest step both ranks saved before (a save in flight at the fault may not have committed)
    newest_both = min(max(s for g, sd in steps_of(job, r).items() if g < gen for s in sd) for r in RANKS)
    if available is not None:
        newest_both = min(newest_both, available)
    assert step in (newest_both, newest_both - 1), (step, newest_both)
    for r in RANKS:
        by_gen = steps_of(job, r)
        before = {s: d for g, sd in by_gen.items() if g < gen for s, d in sd.items()}
        assert resumed[r]["digest"] == before[step], f"rank {r}: resumed weights differ from those saved at {step}"
        after = by_gen[gen]
        assert min(after) == step + 1 and (max(after) == steps or not complete), (r, min(after), max(after))
        assert reference[r][step] == before[step]
        wrong = [s for s, d in after.items() if reference[r][s] != d]
        assert not wrong, f"rank {r}: steps {wrong} differ from the fault-free run"
    return int(step)


def test_relaunched_node_keeps_its_rank(make_job: Callable[..., LocalJob],
                                        fault_free: dict[int, dict[int, str]]) -> None:
    """Item 1: local mode, no replicas (the issue's setting). Node 1 starts first, so torch ranks it
    0 (lower pid); relaunched, it has the higher pid and torch alone would rank it 1."""
    job = make_job(train=["--steps", str(STEPS)], run_args=["--replicas", "0"])
    job.start(order=[1, 0])
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= 8, 120, "both ranks reach step 8")
    held = {n: job.group_rank(n) for n in (0, 1)}
    assert held == {0: 1, 1: 0}, held  # the scenario that swaps: the lost node held rank 0
    job.kill_machine(1)
    job.wait_for(lambda: any(e["event"] == "fault" for e in job.events(0)), 30, "the survivor sees the fault")
    job.start_agent(1)
    assert job.wait_exit(180) == {0: 0, 1: 0}, job.report()
    assert {n: job.group_rank(n) for n in (0, 1)} == held, job.report()
    gen = max(e["generation"] for e in job.trace(0))
    assert gen >= 1
    assert_resumed_on_trajectory(job, gen, fault_free, at_least=7)


def _wipe(root: str) -> None:
    """The relaunched machine's memory tier is empty (a new machine, or /dev/shm lost with the old one)."""
    shutil.rmtree(root)
    Path(root).mkdir()


def test_readme_config_recovers_on_two_nodes_by_default(make_job: Callable[..., LocalJob],
                                                        fault_free: dict[int, dict[int, str]]) -> None:
    """Item 3: global mode, memory tier only, no --replicas and no --durable-url (the README's
    configuration): a worker's SIGKILL, then a lost machine whose replacement has an empty memory tier."""
    job = make_job(train=["--steps", str(STEPS), "--global-mode"])
    job.start()
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= 8, 120, "both ranks reach step 8")
    assert all(e["replicas"] == 1 for e in job.events() if e["event"] == "agent"), job.report()
    os.kill(job.worker_pid(1), signal.SIGKILL)
    for r in RANKS:
        job.wait_for(lambda r=r: job.resumed(r, 1), 90, f"rank {r} resumes in generation 1")
    first = int(job.resumed(0, 1)["step"] or 0)
    job.wait_for(lambda: min(job.last_step(r, generation=1) for r in RANKS) >= first + 8, 90, "8 more steps")
    assert assert_resumed_on_trajectory(job, 1, fault_free, at_least=7, complete=False) == first
    job.wait_for(lambda: replica_steps(job.memory[0]), 30, "node 0 holds a replica")
    job.kill_machine(1)
    _wipe(job.memory[1])
    job.wait_for(lambda: any(e["event"] == "fault" and e["generation"] == 1 for e in job.events(0)), 30,
                 "the survivor sees the lost node")
    job.start_agent(1)
    assert job.wait_exit(180) == {0: 0, 1: 0}, job.report()
    gen = max(e["generation"] for e in job.trace(0))
    assert gen >= 2
    assert_resumed_on_trajectory(job, gen, fault_free, at_least=first + 7)


@pytest.mark.timeout(420)  # the module's fault-free reference run may fall into this test's time
def test_sigkill_of_tierckpt_run_stops_its_workers(make_job: Callable[..., LocalJob],
                                                   fault_free: dict[int, dict[int, str]]) -> None:
    """Item 4: SIGKILL of node 1's ``tierckpt run`` alone (its workers live in their own sessions).
    Its reaper claims LostNode and kills the workers at once; the survivor's events name node 1;
    the relaunched node, its memory tier empty, resumes from its peer's replica (``--replicas 1`` as in
    the issue; local mode, the demo's default)."""
    job = make_job(train=["--steps", str(STEPS)], run_args=["--replicas", "1"])
    job.start()
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= 8, 120, "both ranks reach step 8")
    # replication runs after each commit and lags under load: the kill comes once node 0 holds a
    # replica of step 7 or later, and the relaunched node must resume at least there
    held = job.wait_for(lambda: newest_replica(job.memory[0]) if (newest_replica(job.memory[0]) or 0) >= 7
                        else None, 60, "node 0 holds a replica of step 7 or later")
    assert job.group_rank(1) == 1
    worker = job.worker_pid(1)
    t_kill = time.monotonic()
    os.kill(job.agents[1].pid, signal.SIGKILL)
    job.agents[1].wait(timeout=30)
    job.wait_for(lambda: not alive(worker), 3.0, f"node 1's worker {worker} stops")
    stopped_after = time.monotonic() - t_kill
    print(f"worker stopped {stopped_after:.3f}s after its agent's SIGKILL")
    _wipe(job.memory[1])  # and the replacement has an empty memory tier: it must use the peer's replica
    # node 1's agent replicated its steps: what node 0 holds of rank 1 now is all that is left of it
    # (replication lags saves under load: beside a CPU hog it held step 7 when rank 1 had saved 9)
    available = newest_replica(job.memory[0])
    fault = job.wait_for(lambda: next((e for e in job.events(0) if e["event"] == "fault"), None), 30,
                         "the survivor reports the fault")
    assert (fault["reason"], fault["node"]) == ("LostNode", 1), job.report()
    own = [e for e in job.events(1) if e["event"] == "fault" and e.get("by") == "reaper"]
    assert own and own[0]["reason"] == "LostNode" and "claimed" in own[0]["detail"], job.report()
    job.start_agent(1)
    assert job.wait_exit(180) == {0: 0, 1: 0}, job.report()
    gen = max(e["generation"] for e in job.trace(0))
    assert gen >= 1
    assert_resumed_on_trajectory(job, gen, fault_free, at_least=held, available=available)
    assert "peer" in (job.resumed(1, gen) or {}).get("tiers", []), job.resumed(1, gen)
    assert not [e for e in job.events() if e["event"] == "fault" and e["reason"] == "CrashLoop"]

