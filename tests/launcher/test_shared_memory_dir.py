"""Two ``tierckpt run`` agents of one job on one machine with the same ``--memory-dir`` (the
usual way to try a 2-node job locally): every restart writes the restart-state file from both
agents at once, so each writer needs its own temporary name (issue 24, item 3).

The two agents' writes land within a few milliseconds of each other after each stop barrier,
so the collision the issue saw happens by chance; a third writer of the same file (what a
third agent on the memory root would do, here continuously, through the same ``runstate.save``)
makes it happen at every restart. The job must recover from every fault and finish.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import pytest

from tests.launcher.cluster import LocalJob
from tierckpt.launcher.options import RunOptions
from tierckpt.launcher.supervisor import runstate

pytestmark = pytest.mark.slow

KILLS = 3


def _agent_lines(log: str) -> str:
    """The agent's own output, without its workers' (prefixed ``[default<local rank>]:``)."""
    return "\n".join(line for line in log.splitlines() if not line.startswith("[default"))


def test_two_agents_sharing_a_memory_dir_restart_and_finish(make_job: Callable[..., LocalJob]) -> None:
    job = make_job(train=["--steps", str(12 * KILLS + 12)], max_restarts=KILLS + 2)
    job.memory[1] = job.memory[0]  # both simulated nodes on one memory root
    opts = RunOptions(memory_dir=job.memory[0])
    stop = threading.Event()
    writes: list[int] = [0]

    def third_writer() -> None:
        while not stop.is_set():
            try:
                current = runstate.load(opts, job.rdzv_id)
                if current:  # rewrite what is there (the agents read it only at a rendezvous)
                    runstate.save(opts, job.rdzv_id, current)
                    writes[0] += 1
            except OSError:
                pass  # this writer's own collision (old code) is not what the test looks at

    writer = threading.Thread(target=third_writer, daemon=True)
    job.start()
    writer.start()
    try:
        for k in range(KILLS):
            at, rank = 12 * (k + 1), k % 2
            job.wait_for(lambda at=at, k=k, rank=rank: job.last_step(rank, generation=k) >= at
                         or any(p.poll() is not None for p in job.agents.values()), 120, f"rank {rank} reaches step {at}")
            if any(p.poll() is not None for p in job.agents.values()):
                break  # an agent ended early: the assertions below say how
            os.kill(job.worker_pid(rank), signal.SIGKILL)
            job.wait_for(lambda k=k: all(any(e["event"] in ("restart", "exit") and e["generation"] >= k + 1
                                             for e in job.events(n)) for n in (0, 1))
                         or any(p.poll() is not None for p in job.agents.values()),
                         120, f"both agents restart into generation {k + 1}")
        codes = job.wait_exit(150)
    finally:
        stop.set()
        writer.join(10)
    for n in (0, 1):
        assert "Traceback" not in _agent_lines(job.log(n)), job.report()
    assert codes == {0: 0, 1: 0}, job.report()
    assert writes[0] > 0  # the third writer did write
    for r in (0, 1):
        assert job.last_step(r, generation=KILLS) == 12 * KILLS + 12, job.report()
    leftovers = [p for p in os.listdir(os.path.join(job.memory[0], runstate.STATE_DIR)) if ".tmp" in p]
    assert leftovers == [], leftovers


def test_an_error_in_the_launcher_loop_ends_with_an_exit_event_not_a_traceback(
        make_job: Callable[..., LocalJob]) -> None:
    """The restart-state file cannot be written at the first restart (its directory became a
    file): the agent stops its workers and exits 70 with an ``exit`` event and one line on stderr."""
    job = make_job(nnodes=1, train=["--steps", "400"])
    job.start()
    job.wait_for(lambda: job.last_step(0) >= 5, 120, "rank 0 reaches step 5")
    state_dir = os.path.join(job.memory[0], runstate.STATE_DIR)
    for name in os.listdir(state_dir):
        os.unlink(os.path.join(state_dir, name))
    os.rmdir(state_dir)
    with open(state_dir, "w") as f:
        f.write("not a directory")
    worker = job.worker_pid(0)
    os.kill(worker, signal.SIGKILL)
    assert job.wait_exit(60) == {0: 70}, job.report()
    ev = job.events(0)
    assert ev[-1]["event"] == "exit" and ev[-1]["code"] == 70, ev[-1]
    why = ev[-1]["why"]
    assert why.startswith("launcher error: ") and "(at tierckpt/" in why and "\n" not in why, why
    log = _agent_lines(job.log(0))
    assert "Traceback" not in log, log
    assert f"tierckpt run: error: {why[len('launcher error: '):]} (exit 70)" in log, log
    started = [e for e in ev if e["event"] == "started"][0]
    from tests.launcher.cluster import alive

    assert not any(alive(pid) for pid in started["pids"])  # its workers were stopped
