"""A repeat offender avoided at a full job restart, under ``tierckpt run`` on real processes
(agents on 127.0.0.1, each its own memory root, 1 worker each, gloo, ``--nnodes 2:2``).

Node 1's worker crashes in generations 0 and 1 (the demo's ``--fault-memory-dir``).
``numRestartBeforeFullJobRestart: 1`` makes the second crash a full job restart (exit 75) and
``maxNumRepeatOffendersToAvoid: 1`` names node 1 the node the next start avoids: both agents
write the ``offender`` event (``at: "full_restart"``), the restart-state file's ``avoid`` and the
``--avoid-file`` hint. The "scheduler" (this test) then starts the job again, with node 1's agent
first and a spare after it: node 1 takes no seat, the spare gets rank 1 and resumes it from the
durable tier, bit-identical, and node 1 stands by at the gate to the end.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.launcher.cluster import LocalJob
from tests.launcher.test_node_loss import steps_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RANKS = (0, 1)
STEPS = 40


def test_a_full_restart_avoids_the_repeat_offender_and_a_spare_takes_its_rank(make_job: Callable[..., LocalJob],
                                                                             tmp_path: Path) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text("jobMaxRetryCount: 10\nrestartPolicy:\n  numRestartBeforeFullJobRestart: 1\n"
                        "  evalPeriodSeconds: 3600\n  maxNumRepeatOffendersToAvoid: 1\n")
    hint = tmp_path / "sched" / "avoid"
    job = make_job(train=["--steps", str(STEPS), "--step-time", "0.1", "--fault", "exit", "--fault-step", "4",
                          "--fault-generation", "-1", "--fault-limit", "2"],
                   run_args=["--avoid-file", str(hint), "--avoid-wait", "90"], slots=3, nnodes_arg="2:2",
                   job_file=job_file, durable=f"file://{tmp_path / 'durable'}")
    job.train += ["--fault-memory-dir", job.memory[1]]
    node1 = f"{socket.gethostname()}:{job.memory[1]}"
    job.start(order=[0, 1])
    assert job.wait_exit(180) == {0: 75, 1: 75}, job.report()
    for node in (0, 1):
        offenders = [e for e in job.events(node) if e["event"] == "offender"]
        assert len(offenders) == 1, job.report()
        ev = offenders[0]
        assert ev["at"] == "full_restart" and ev["identity"] == node1 and ev["node"] == 1, ev
        assert ev["machine"] == socket.gethostname() and ev["faults"] == 2 and ev["window_s"] == 3600, ev
        state = json.loads((Path(job.memory[node]) / ".tierckpt-run" / f"{job.rdzv_id}.json").read_text())
        assert state["avoid"] == [{"identity": node1, "machine": socket.gethostname(), "faults": 2}], state
    assert hint.read_text() == f"{socket.gethostname()}\n"
    before = max(e["generation"] for e in job.trace(0))

    # the scheduler starts the job again: node 0, the offender, and only then a spare
    job.start(order=[0, 1])
    avoided = job.wait_for(lambda: next((e for e in job.events(1) if e["event"] == "spare"
                                         and e["state"] == "avoided"), None), 120, "node 1 finds itself avoided")
    assert avoided["identity"] == node1 and avoided["faults"] == 2 and "repeat offender" in avoided["why"], avoided
    job.start_agent(2)
    codes = job.wait_exit(300)
    assert codes == {0: 0, 1: 0, 2: 0}, job.report()
    gen = max(e["generation"] for e in job.trace(1))
    assert gen > before
    started = [e for e in job.events(2) if e["event"] == "started"]
    assert started and started[0]["node"] == 1, job.report()  # the spare holds rank 1
    assert [e["generation"] for e in job.events(1) if e["event"] == "started"] == [0], job.report()  # not again
    assert not [e for e in job.events(1) if e["event"] == "spare" and e["state"] == "avoid_ended"], job.report()
    exit1 = [e for e in job.events(1) if e["event"] == "exit"]
    assert exit1[-1]["code"] == 0 and "spare" in exit1[-1]["why"], exit1  # it stood by to the end
    # the spare's rank 1 resumed the step the full restart persisted: the weights rank 0 had there
    resumed = job.resumed(1, gen)
    assert resumed is not None and resumed["step"] is not None, job.report()
    earlier = {s: d for g, sd in steps_of(job, 0).items() if g < gen for s, d in sd.items()}
    assert resumed["digest"] == earlier[resumed["step"]], (resumed, job.report())
    assert all(job.last_step(r) == STEPS for r in RANKS)
