"""Repeat offenders under ``tierckpt run`` on real processes: two nodes and a hot spare (three
agents on 127.0.0.1, each its own memory root, 1 worker each, gloo, ``--nnodes 2:2``).

Node 1's worker crashes in two generations in a row (the demo's ``--fault-memory-dir``: only the
worker whose memory tier is node 1's, whatever rank it holds). With
``maxNumRepeatOffendersToAvoid: 1`` the second crash makes node 1 a repeat offender: it stands
aside at the spare gate and the waiting spare takes rank 1 (a process restart, no job restart).
With ``0`` node 1 is restarted in place and the spare is never used: that decision is unit-tested
(``tests/unit/launcher/test_avoid.py``) and run on namespaced hosts
(``tests/cluster/test_offenders.py::test_without_the_policy_the_offender_host_restarts_in_place``);
its loopback twin left the slow tier (issue 25: a scenario that only re-proved a tested decision).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.launcher.cluster import LocalJob, offenders_job_file, replica_steps
from tests.launcher.test_node_loss import steps_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RANKS = (0, 1)
STEPS = 300  # 0.3 s each: the job outlasts the spare's start-up on a loaded machine


def _host() -> str:
    import socket

    return socket.gethostname()


def _two_crashes_on_node_1(make_job: Callable[..., LocalJob], tmp_path: Path, max_avoid: int) -> LocalJob:
    """Start the job and the spare; once the spare stands by warm and node 0 holds a replica,
    node 1's worker crashes in generation 0 and again at its first step of generation 1."""
    fault_file = tmp_path / f"crash-now-{max_avoid}"
    job = make_job(train=["--steps", str(STEPS), "--step-time", "0.3", "--fault", "exit", "--fault-generation", "-1",
                          "--fault-file", str(fault_file), "--fault-limit", "2"],
                   run_args=["--replicas", "1"], slots=3, nnodes_arg="2:2",
                   job_file=offenders_job_file(tmp_path, max_avoid))
    job.train += ["--fault-memory-dir", job.memory[1]]
    job.start(order=[0, 1])
    job.wait_for(lambda: all(any(e["event"] == "started" for e in job.events(n)) for n in (0, 1)), 120,
                 "nodes 0 and 1 form the job")
    job.start_agent(2)  # the job is full: the third agent stands by at the spare gate
    job.wait_for(lambda: any(e["event"] == "spare" and e["state"] == "standby" for e in job.events(2)), 150,
                 "the spare stands by at the gate")
    job.wait_for(lambda: replica_steps(job.memory[0]), 60, "node 0 holds a replica")
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= 5, 60, "both ranks reach step 5")
    assert job.last_step(0) < STEPS - 100, "the job trained too far before the spare stood by; raise STEPS"
    fault_file.write_text("crash")
    job.wait_for(lambda: len([e for e in job.events(0) if e["event"] == "fault"]) >= 2, 120,
                 "two faults reach node 0")
    return job


def _faults(job: LocalJob) -> list[dict[str, Any]]:
    return [e for e in job.events(0) if e["event"] == "fault"]


def test_repeat_offender_stands_aside_and_the_spare_takes_its_rank(make_job: Callable[..., LocalJob],
                                                                  tmp_path: Path) -> None:
    job = _two_crashes_on_node_1(make_job, tmp_path, max_avoid=1)
    t_second = time.time()
    node1 = f"{_host()}:{job.memory[1]}"
    offender = job.wait_for(lambda: next((e for e in job.events(1) if e["event"] == "offender"), None), 60,
                            "node 1 reports itself a repeat offender")
    assert offender["identity"] == node1 and offender["faults"] == 2 and offender["spares"] == 1, offender
    assert [e["identity"] for e in job.events(0) if e["event"] == "offender"] == [node1]  # every node says so
    joined = job.wait_for(lambda: next((e for e in job.events(2) if e["event"] == "spare"
                                        and e["state"] == "joined"), None), 90, "the spare takes rank 1")
    assert joined["node"] == 1 and joined["replaced"] == node1, joined
    gen = int(joined["generation"])
    aside = [e for e in job.events(1) if e["event"] == "spare" and e["state"] == "standby"]
    assert aside and aside[0]["identity"] == node1, job.report()  # node 1 waits at the gate now
    job.wait_for(lambda: all(job.last_step(r, generation=gen) > 0 for r in RANKS), 90,
                 f"both ranks train in generation {gen}")
    print(f"repeat offender: second crash -> both ranks training on the spare: "
          f"{max(min(e['time'] for e in job.trace(r) if e['event'] == 'step' and e['generation'] == gen) for r in RANKS) - t_second:.2f}s")
    codes = job.wait_exit(300)
    assert codes == {0: 0, 1: 0, 2: 0}, job.report()
    exit1 = [e for e in job.events(1) if e["event"] == "exit"]
    assert exit1 and "spare" in exit1[-1]["why"], exit1  # it stood by to the end
    assert not [e for e in job.events() if e["event"] == "restart" and e.get("kind") == "job"], job.report()
    assert [(e["reason"], e["node"], e["rank"]) for e in _faults(job)] == [("Crash", 1, 1)] * 2, _faults(job)
    changes = [e for e in job.events(0) if e["event"] == "membership"]
    assert changes and changes[-1]["replaced"] == [{"node": 1, "left": node1, "by": f"{_host()}:{job.memory[2]}"}]
    # the spare's rank 1 resumed where the pair left off: the weights rank 0 had at that step
    resumed = job.resumed(1, gen)
    assert resumed is not None and resumed["step"] is not None, resumed
    earlier = {s: d for g, sd in steps_of(job, 0).items() if g < gen for s, d in sd.items()}
    assert resumed["digest"] == earlier[resumed["step"]], (resumed, job.report())
    assert all(job.last_step(r) == STEPS for r in RANKS)
