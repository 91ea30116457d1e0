"""``tierckpt run`` on real processes: 2 agents x 1 worker, gloo on 127.0.0.1, real signals.

Each scenario checks that every rank stopped, the job-wide generation advanced, the resumed
step is the newest step both ranks committed (and the resumed parameters equal, bit for bit,
the ones saved at that step), and that the events say so.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.launcher.cluster import NS, LocalJob, newest_replica

pytestmark = pytest.mark.slow

RANKS = (0, 1)


def saved_digests(job: LocalJob, rank: int, below_generation: int) -> dict[int, str]:
    return {e["step"]: e["digest"] for e in job.trace(rank)
            if e["event"] == "step" and e["generation"] < below_generation}


def assert_recovered(job: LocalJob, generation: int, reason: str, *, node: int, rank: int | None = None,
                     before: int | None = None) -> int:
    """Generation ``generation`` faulted with ``reason``, blamed on ``node`` (and ``rank``) in every
    node's events; ``generation + 1`` resumed correctly: the newest step both ranks saved, or with
    ``before`` (a non-finite loss at that step) the step before it."""
    nxt = generation + 1
    for n in range(job.nnodes):
        ev = job.events(n)
        faults = [e for e in ev if e["event"] == "fault" and e["generation"] == generation]
        assert faults and faults[0]["reason"] == reason, job.report()
        assert faults[0]["node"] == node and rank in (None, faults[0]["rank"]), (faults[0], job.report())
        assert any(e["event"] == "stopped" and e["generation"] == generation for e in ev), job.report()
        assert any(e["event"] == "restart" and e["kind"] == "process" and e["generation"] == nxt for e in ev)
    resumed = {r: job.wait_for(lambda r=r: job.resumed(r, nxt), 60, f"rank {r} resumes in generation {nxt}")
               for r in RANKS}
    steps = {r: resumed[r]["step"] for r in RANKS}
    assert len(set(steps.values())) == 1 and steps[0] is not None and steps[0] >= 1, steps
    step = steps[0]
    for r in RANKS:
        assert resumed[r]["restart_count"] == nxt and resumed[r]["generation"] == nxt  # job-wide, both ranks
        assert resumed[r]["tiers"] == ["memory"]
        saved = saved_digests(job, r, nxt)
        assert resumed[r]["digest"] == saved[step], "resumed state differs from the state saved at that step"
        # the newest step both ranks saved before the fault (a save in flight may not have committed)
        newest_both = min(max(saved_digests(job, q, nxt)) for q in RANKS)
        if before is not None:  # nothing the NaN may have reached (a commit in flight may not have landed)
            assert step in (before - 1, before - 2), (step, before)
        else:
            assert step in (newest_both, newest_both - 1), (step, newest_both)
    # every worker of the faulty generation was stopped: their pids are gone
    for e in job.events():
        if e["event"] == "started" and e["generation"] == generation:
            for pid in e["pids"]:
                assert not _alive(pid), f"worker {pid} of generation {generation} still runs"
    return int(step)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_worker_sigkill_restarts_in_place_and_no_restart_hangs(make_job: Callable[..., LocalJob]) -> None:
    """Also pytorch#135712's scenario: two agents, a worker killed; the restart must not hang."""
    job = make_job(train=["--steps", "40"])
    job.start()
    job.wait_for(lambda: job.last_step(1) >= 8, 90, "rank 1 reaches step 8")
    os.kill(job.worker_pid(1), signal.SIGKILL)
    codes = job.wait_exit(120)
    assert codes == {0: 0, 1: 0}, job.report()
    assert_recovered(job, 0, "Crash", node=1, rank=1)
    for r in RANKS:
        assert job.last_step(r, generation=1) == 40
    assert all(e["code"] == 0 for e in job.events() if e["event"] == "exit")


def test_sigstop_is_a_hang(make_job: Callable[..., LocalJob]) -> None:
    job = make_job(train=["--steps", "40"])
    job.start()
    job.wait_for(lambda: job.last_step(0) >= 8, 90, "rank 0 reaches step 8")
    job.wait_for(lambda: any(e["event"] == "timeout" for e in job.events()), 30, "heartbeat timeout calibrated")
    os.kill(job.worker_pid(0), signal.SIGSTOP)
    assert job.wait_exit(120) == {0: 0, 1: 0}, job.report()
    # rank 1 waits in the all-reduce for the stopped rank 0: its stall is a symptom, the stop the cause
    assert_recovered(job, 0, "Hang", node=0, rank=0)
    fault = next(e for e in job.events(0) if e["event"] == "fault")
    # the stopped process decides (hang.py), before the 5 s beat-only floor and the idle limit
    assert "stopped (state T)" in fault["detail"] and 3.0 <= fault["detection_latency_s"] <= 5.0, fault


def test_nan_loss_through_monitor_step(make_job: Callable[..., LocalJob]) -> None:
    job = make_job(train=["--steps", "30", "--fault", "nan", "--fault-step", "8"])
    job.start()
    assert job.wait_exit(150) == {0: 0, 1: 0}, job.report()
    assert_recovered(job, 0, "NonFiniteLoss", node=1, rank=1, before=8)
    fault = next(e for e in job.events(1) if e["event"] == "fault")
    assert fault["rank"] == 1 and fault["step"] == 8


def _job_yaml(tmp: Path, rules: str, extra: str = "") -> Path:
    path = tmp / "job.yaml"
    path.write_text(f"""apiVersion: sagemaker.amazonaws.com/v1
kind: HyperPodPyTorchJob
metadata:
  name: scenario
spec:
  nprocPerNode: "1"
  runPolicy:
    jobMaxRetryCount: 3
{extra}    logMonitoringConfiguration:
{rules}""")
    return path


def test_nan_loss_through_a_log_rule(make_job: Callable[..., LocalJob], tmp_path: Path) -> None:
    rules = """      - name: NaNLoss
        logPattern: ".*Loss: nan.*"
        faultOnMatch: true
"""
    job = make_job(train=["--steps", "30", "--fault", "nan", "--fault-step", "8"], job_file=_job_yaml(tmp_path, rules),
                   run_args=["--heartbeat-timeout", "600"])
    # the heartbeat also sees the NaN: make the rule the faster detector by hiding the loss from it
    job.train += ["--fault-rank", "1"]
    job.start()
    assert job.wait_exit(150) == {0: 0, 1: 0}, job.report()
    reasons = {e["reason"] for e in job.events() if e["event"] == "fault" and e["generation"] == 0}
    assert len(reasons) == 1 and reasons <= {"LogFault_NaNLoss", "NonFiniteLoss"}, reasons
    assert_recovered(job, 0, reasons.pop(), node=1, rank=1, before=8)  # saves after the NaN beat were held back


def test_silent_loss_trips_the_recurring_rule(make_job: Callable[..., LocalJob], tmp_path: Path) -> None:
    rules = """      - name: JobStart
        logPattern: ".*Loss:.*"
        expectedStartCutOffInSeconds: 60
      - name: JobHangingDetection
        logPattern: ".*Loss: ([0-9.]+).*"
        expectedRecurringFrequencyInSeconds: 2
"""
    job = make_job(train=["--steps", "40", "--fault", "silent", "--fault-step", "8"], job_file=_job_yaml(tmp_path, rules))
    job.start()
    assert job.wait_exit(150) == {0: 0, 1: 0}, job.report()
    assert_recovered(job, 0, "LogHang_JobHangingDetection", node=1, rank=1)


def test_crash_on_start_backs_off_then_crash_loop(make_job: Callable[..., LocalJob]) -> None:
    job = make_job(train=["--fault", "crash_on_start", "--fault-generation", "-1"], max_restarts=10)
    job.start()
    codes = job.wait_exit(120)
    assert codes == {0: 1, 1: 1}, job.report()
    for node in range(2):
        ev = job.events(node)
        exit_ev = [e for e in ev if e["event"] == "exit"]
        assert exit_ev and exit_ev[-1]["code"] == 1 and "CrashLoop" in exit_ev[-1]["why"], ev
        delays = [e["delay_s"] for e in ev if e["event"] == "backoff"]
        assert delays and all(b > a for a, b in zip(delays, delays[1:], strict=False)), delays
        assert len([e for e in ev if e["event"] == "fault"]) == 3  # the crash-loop limit, not 10 restarts


def test_agent_killed_is_a_lost_node_then_replaced(make_job: Callable[..., LocalJob]) -> None:
    job = make_job(train=["--steps", "60"])
    job.start()
    job.wait_for(lambda: job.last_step(1) >= 8, 90, "rank 1 reaches step 8")
    job.kill_node(1)  # agent and worker
    job.wait_for(lambda: any(e["event"] == "fault" and e["reason"] == "LostNode" for e in job.events(0)), 30,
                 "the survivor notices the lost agent")
    lost = next(e for e in job.events(0) if e["event"] == "fault")
    assert lost["node"] == 1
    job.start_agent(1)  # the replacement node (same memory root: the machine came back)
    assert job.wait_exit(150) == {0: 0, 1: 0}, job.report()
    gen = max(e["generation"] for e in job.trace(0))
    assert gen >= 1
    resumed = {r: job.resumed(r, gen) for r in RANKS}
    # killed right after step 8: its save may not have committed (the reaper stops the worker at once)
    assert all(v is not None and v["step"] is not None and v["step"] >= 7 for v in resumed.values()), resumed
    assert resumed[0]["step"] == resumed[1]["step"]
    assert job.last_step(0, generation=gen) == 60


def test_escalation_to_full_restart_exit_code(make_job: Callable[..., LocalJob], tmp_path: Path) -> None:
    extra = """    restartPolicy:
      numRestartBeforeFullJobRestart: 1
      evalPeriodSeconds: 3600
      maxFullJobRestarts: 2
"""
    rules = """      - name: JobStart
        logPattern: ".*Loss:.*"
        expectedStartCutOffInSeconds: 120
"""
    job = make_job(train=["--steps", "200", "--fault", "exit", "--fault-step", "6", "--fault-generation", "-1"],
                   job_file=_job_yaml(tmp_path, rules, extra))
    job.start()
    codes = job.wait_exit(150)
    assert codes == {0: 75, 1: 75}, job.report()
    for node in range(2):
        ev = job.events(node)
        assert [e["kind"] for e in ev if e["event"] == "restart"] == ["process", "job"]
        state = json.loads((Path(job.memory[node]) / ".tierckpt-run" / f"{job.rdzv_id}.json").read_text())
        assert state["full_restarts"] == 1 and state["next_generation"] == 2
    # the outer scheduler recreates the agents: the generation goes on from where it was
    job.train = ["--steps", "12"]
    job.start()
    assert job.wait_exit(150) == {0: 0, 1: 0}, job.report()
    started = [e for e in job.events(0) if e["event"] == "started"]
    assert started[-1]["generation"] == 2
    assert job.resumed(0, 2)["step"] >= 5  # rank 1 exits at step 6 before saving it


def test_sigterm_persists_the_newest_step(make_job: Callable[..., LocalJob], tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    job = make_job(train=["--steps", "400"], durable=f"file://{durable}")
    job.start()
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= 8, 90, "both ranks reach step 8")
    for n in range(2):
        job.agents[n].send_signal(signal.SIGTERM)
    codes = job.wait_exit(60)
    assert codes == {0: 128 + signal.SIGTERM, 1: 128 + signal.SIGTERM}, job.report()
    newest = min(job.last_step(r) for r in RANKS)
    for r in RANKS:
        ns_dir = durable / f"{NS}--rank{r}"
        steps = sorted(int(p.name.split("_")[1]) for p in ns_dir.glob("step_*") if (p / "COMMITTED").exists())
        assert steps and steps[-1] >= newest - 1, (r, steps, newest)
    persisted = [e for e in job.events() if e["event"] == "persisted"]
    assert len(persisted) == 2


def test_hosted_agents_replicate_and_a_lost_node_resumes_from_its_peer(make_job: Callable[..., LocalJob]) -> None:
    """``tierckpt run --replicas 1``: no durable tier and no ``--peers`` (the hosted agents find each
    other through the rendezvous store); node 1 is lost with its memory root, the replacement's
    rank loads its shards from node 0's replica (tier 'peer')."""
    job = make_job(train=["--steps", "60", "--global-mode"])
    job.per_node_args = {n: ["--replicas", "1", "--agent-listen=127.0.0.1:0"] for n in (0, 1)}
    job.start()
    job.wait_for(lambda: job.last_step(1) >= 8, 90, "rank 1 reaches step 8")
    # replication follows each commit and lags under load: kill once node 0 holds step 7 or later
    held = job.wait_for(lambda: newest_replica(job.memory[0]) if (newest_replica(job.memory[0]) or 0) >= 7
                        else None, 60, "node 0 holds a replica of step 7 or later")
    job.kill_node(1)
    import shutil

    shutil.rmtree(job.memory[1])
    Path(job.memory[1]).mkdir()
    job.wait_for(lambda: any(e["event"] == "fault" and e["reason"] == "LostNode" for e in job.events(0)), 30,
                 "the survivor notices the lost node")
    job.start_agent(1)
    assert job.wait_exit(150) == {0: 0, 1: 0}, job.report()
    gen = max(e["generation"] for e in job.trace(0))
    resumed = {r: job.resumed(r, gen) for r in RANKS}
    # the newest step every rank holds: node 0's own and its replica of node 1's, at least the one held at the kill
    assert all(v is not None and v["step"] is not None and v["step"] >= held for v in resumed.values()), (held, resumed)
    assert resumed[0]["step"] == resumed[1]["step"]
    assert "peer" in (resumed[0]["tiers"] or []) + (resumed[1]["tiers"] or []), resumed
    step = resumed[0]["step"]
    for r in RANKS:
        assert resumed[r]["digest"] == saved_digests(job, r, gen)[step]


def test_active_deadline_fails_the_job(make_job: Callable[..., LocalJob], tmp_path: Path) -> None:
    """``activeDeadlineSeconds``: the job's wall-clock limit; the newest step is kept, every agent exits 1."""
    rules = """      - name: JobStart
        logPattern: ".*Loss:.*"
        expectedStartCutOffInSeconds: 120
"""
    # 30 s: the first start hands the ranks to standbys still importing torch (12 s here under load)
    job = make_job(train=["--steps", "100000"], job_file=_job_yaml(tmp_path, rules, "    activeDeadlineSeconds: 30\n"))
    job.start()
    assert job.wait_exit(120) == {0: 1, 1: 1}, job.report()
    for node in range(2):
        ev = job.events(node)
        fault = next(e for e in ev if e["event"] == "fault")
        assert fault["reason"] == "ActiveDeadline" and fault["generation"] == 0
        assert ev[-1]["event"] == "exit" and ev[-1]["why"] == "activeDeadlineSeconds exceeded"
        assert not [e for e in ev if e["event"] == "restart"]
    assert all(job.last_step(r) >= 1 for r in RANKS), job.report()  # it trained until the deadline


def test_startup_deadline_fails_the_job(make_job: Callable[..., LocalJob], tmp_path: Path) -> None:
    """``startupDeadlineSeconds``: a generation with no first heartbeat and no log-rule match in time
    fails the job (exit 1 on every agent, no restart), as the operator fails a job that does not start;
    ``expectedStartCutOffInSeconds`` (a rule's own start deadline) is a fault that restarts instead."""
    rules = """      - name: JobStart
        logPattern: ".*Loss:.*"
"""
    job = make_job(train=["--steps", "100", "--fault", "stall_on_start", "--fault-rank", "1"],
                   job_file=_job_yaml(tmp_path, rules, "    startupDeadlineSeconds: 8\n"))
    job.start()
    assert job.wait_exit(90) == {0: 1, 1: 1}, job.report()
    for node in range(2):
        ev = job.events(node)
        fault = next(e for e in ev if e["event"] == "fault")
        assert fault["reason"] == "StartupDeadline" and fault["generation"] == 0, fault  # rank 0 waits on rank 1
        assert ev[-1]["event"] == "exit" and ev[-1]["why"] == "startupDeadlineSeconds exceeded", ev[-1]
        assert not [e for e in ev if e["event"] == "restart"]

