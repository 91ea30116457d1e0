"""A full job restart that lands on new machines (fresh memory roots) keeps the job's restart
state: the durable copy of the restart-state file is read back (issue 24, item 5). The
generation, the restarts counted against ``jobMaxRetryCount`` and the job's first start
(``activeDeadlineSeconds``) go on from where the first incarnation left them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.launcher.cluster import LocalJob

pytestmark = pytest.mark.slow


def _job_file(tmp: Path) -> Path:
    path = tmp / "job.yaml"
    path.write_text("jobMaxRetryCount: 3\nrestartPolicy:\n  numRestartBeforeFullJobRestart: 1\n"
                    "  evalPeriodSeconds: 3600\n  maxFullJobRestarts: 2\n")
    return path


def _state(memory: str, job: LocalJob) -> dict:
    return dict(json.loads((Path(memory) / ".tierckpt-run" / f"{job.rdzv_id}.json").read_text()))


def test_a_full_restart_on_fresh_machines_keeps_the_restart_state(make_job: Callable[..., LocalJob],
                                                                  shm: Callable[[str], str], tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    # every step durable too: rank 1 exits at step 6 before saving it, so the newest step each rank
    # holds differs and the copy made on the way out alone would leave no common step (local mode)
    job = make_job(train=["--steps", "200", "--fault", "exit", "--fault-step", "6", "--fault-generation", "-1",
                          "--durable-every", "1"], job_file=_job_file(tmp_path), durable=f"file://{durable}")
    job.start()
    assert job.wait_exit(150) == {0: 75, 1: 75}, job.report()  # 2 faults in the window: a full restart
    first = _state(job.memory[0], job)
    assert first["next_generation"] == 2 and first["full_restarts"] == 1 and first["restarts"] == 2, first
    # each node keeps its own first start (a fraction of a second apart); the durable copy is one of them
    started_at = {_state(m, job)["job_started"] for m in job.memory}
    # the outer scheduler places the job on new machines: empty memory roots, the durable tier stays
    job.memory = [shm(f"fresh{n}") for n in range(job.nnodes)]
    job.train = ["--steps", "16", "--fault", "exit", "--fault-step", "12", "--fault-generation", "2",
                 "--durable-every", "1"]
    job.start()
    assert job.wait_exit(150) == {0: 0, 1: 0}, job.report()
    for node in range(job.nnodes):
        ev = job.events(node)
        started = [e for e in ev if e["event"] == "started"]
        assert started[-1]["generation"] == 2, started  # not 0: the state came from the durable tier
        restart = [e for e in ev if e["event"] == "restart"][-1]
        assert restart["generation"] == 3 and restart["why"] == "process restart 3 of 3", restart
        again = _state(job.memory[node], job)  # written at that restart, on the new machine
        assert again["job_started"] in started_at and again["full_restarts"] == 1, (again, started_at)
        assert again["restarts"] == 3 and again["next_generation"] == 3, again
    resumed = job.resumed(0, 2)
    assert resumed is not None and resumed["step"] is not None and resumed["step"] >= 5, resumed
    assert "durable" in resumed["tiers"], resumed  # the fresh memory held nothing
