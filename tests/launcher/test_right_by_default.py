"""Issue 15 on real processes (2 agents x 1 worker, gloo on 127.0.0.1): workers resume below a
non-finite loss until the job moved past it; restarts are counted across full job restarts; a
lone agent says what it waits for; the events carry the node index, the host, the crash
detection latency and the recovery time to the first step."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.launcher.cluster import LocalJob
from tests.launcher.test_scenarios import RANKS, _job_yaml

pytestmark = pytest.mark.slow


def _start(job: LocalJob, rank: int, generation: int) -> dict[str, object]:
    return next(e for e in job.trace(rank) if e["event"] == "start" and e["generation"] == generation)


def test_after_a_nan_workers_resume_before_its_step_until_the_job_moved_past_it(
        make_job: Callable[..., LocalJob]) -> None:
    job = make_job(train=["--steps", "60", "--fault", "nan", "--fault-step", "8"])
    job.start()
    job.wait_for(lambda: all(job.resumed(r, 1) for r in RANKS), 120, "both ranks resume in generation 1")
    for r in RANKS:  # every worker of the next generation, not only the NaN rank's
        assert _start(job, r, 1)["resume_before"] == "8", job.trace(r)
    for node in range(2):
        restart = next(e for e in job.events(node) if e["event"] == "restart")
        assert restart["generation"] == 1 and restart["resume_before"] == 8, restart
    fault = next(e for e in job.events(1) if e["event"] == "fault")
    assert (fault["reason"], fault["node"], fault["rank"]) == ("NonFiniteLoss", 1, 1) and fault["step"] >= 8
    # generation 1 trains finitely past step 8 on both ranks: a later restart resumes normally
    job.wait_for(lambda: min(job.last_step(r, generation=1) for r in RANKS) >= 12, 90, "generation 1 passes step 12")
    os.kill(job.worker_pid(1), signal.SIGKILL)
    assert job.wait_exit(150) == {0: 0, 1: 0}, job.report()
    for r in RANKS:
        assert _start(job, r, 2)["resume_before"] is None, job.trace(r)
    events = job.events()
    assert {e["node"] for e in events} == {0, 1} and all(isinstance(e["host"], str) for e in events)
    crash = next(e for e in job.events(1) if e["event"] == "fault" and e["generation"] == 1)
    assert (crash["reason"], crash["node"], crash["rank"]) == ("Crash", 1, 1), crash
    assert 0 <= crash["detection_latency_s"] < 1.0, crash
    for node in range(2):
        restart = next(e for e in job.events(node) if e["event"] == "restart" and e["generation"] == 2)
        recovered = next(e for e in job.events(node) if e["event"] == "recovered" and e["generation"] == 2)
        assert restart["resume_before"] is None
        assert recovered["recovery_s"] >= restart["handover_s"], (restart, recovered)


def test_job_max_retry_count_counts_across_full_job_restarts(make_job: Callable[..., LocalJob],
                                                             tmp_path: Path) -> None:
    """jobMaxRetryCount 2: restart 1 (process), restart 2 (full job, exit 75); the recreated
    agents' first fault would be restart 3: the job fails instead of starting over at 1."""
    extra = """    restartPolicy:
      numRestartBeforeFullJobRestart: 1
      evalPeriodSeconds: 3600
"""
    yaml = _job_yaml(tmp_path, "", extra).read_text().replace("jobMaxRetryCount: 3", "jobMaxRetryCount: 2")
    yaml = yaml.replace("    logMonitoringConfiguration:\n", "")
    (tmp_path / "job.yaml").write_text(yaml)
    job = make_job(train=["--steps", "200", "--fault", "exit", "--fault-step", "4", "--fault-generation", "-1"],
                   job_file=tmp_path / "job.yaml")
    job.start()
    assert job.wait_exit(150) == {0: 75, 1: 75}, job.report()
    job.start()  # the outer scheduler recreates the agents
    assert job.wait_exit(150) == {0: 1, 1: 1}, job.report()
    for node in range(2):
        last = job.events(node)[-1]
        assert last["event"] == "exit" and last["why"] == "runPolicy.jobMaxRetryCount 2 reached", last
        assert last["generation"] == 2


def test_a_lone_agent_says_what_it_waits_for(make_job: Callable[..., LocalJob]) -> None:
    job = make_job()
    job.start_agent(0)
    want = f"tierckpt run: waiting for nodes at 127.0.0.1:{job.port}: 1 of 2 joined"
    job.wait_for(lambda: want in job.log(0), 60, repr(want))


WATCHED = """
import os, sys, time
from torch.distributed.elastic.timer import FileTimerClient, configure, expires
print("timer file", os.environ.get("TORCHELASTIC_TIMER_FILE"), flush=True)
configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
with expires(after=1):
    time.sleep(120)  # stuck past its timer: torch's watchdog SIGKILLs it
"""


def test_torchs_file_timer_watchdog_kills_a_stuck_worker(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.launcher.cluster import read_jsonl

    script = tmp_path / "watched.py"
    script.write_text(WATCHED)
    events = tmp_path / "ev.jsonl"
    env = dict(os.environ, TORCHELASTIC_ENABLE_FILE_TIMER="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "tierckpt.cli", "run", "--standalone", "--nproc-per-node=1",
                           "--max-restarts=0", "--monitor-interval=0.1", f"--events={events}",
                           f"--memory-dir={tmp_path / 'shm'}", str(script)],  # not the shared /dev/shm/tierckpt
                          env=env, capture_output=True, text=True, timeout=120, start_new_session=True)
    # torchrun's own server SIGKILLs the agent too (rc -9): here the agent lives and decides
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fault = next(e for e in read_jsonl(events) if e["event"] == "fault")
    assert (fault["reason"], fault["node"], fault["rank"]) == ("Crash", 0, 0), fault
    assert fault["detail"].startswith("killed by SIGKILL (torch's file timer"), (fault, proc.stderr[-2000:])
    last = read_jsonl(events)[-1]
    assert last["why"] == "--max-restarts 0 reached", last


def test_the_resume_bound_survives_a_full_job_restart(make_job: Callable[..., LocalJob], tmp_path: Path) -> None:
    """numRestartBeforeFullJobRestart 0: the NaN's fault is a full job restart (exit 75); the
    restart-state file keeps the bound and the recreated agents' workers get it."""
    import json

    path = tmp_path / "job.yaml"
    path.write_text("jobMaxRetryCount: 5\nrestartPolicy:\n  numRestartBeforeFullJobRestart: 0\n"
                    "  evalPeriodSeconds: 3600\n")
    job = make_job(train=["--steps", "20", "--fault", "nan", "--fault-step", "6"], job_file=path)
    job.start()
    assert job.wait_exit(150) == {0: 75, 1: 75}, job.report()
    for node in range(2):
        state = json.loads((Path(job.memory[node]) / ".tierckpt-run" / f"{job.rdzv_id}.json").read_text())
        assert state["resume_before"] == 6 and state["next_generation"] == 1 and state["restarts"] == 1, state
    job.start()
    assert job.wait_exit(150) == {0: 0, 1: 0}, job.report()
    for r in RANKS:
        assert _start(job, r, 1)["resume_before"] == "6", job.trace(r)
