"""A full job restart on new hosts keeps the job's restart state (issue 24, item 5).

2 hosts x 1 worker of ``tierckpt.demo.resilient`` with a ``file://`` durable tier on the shared
disk; every generation exits at step 6, so the second fault within the window is a full job
restart (exit 75). The job then starts again on two *new* hosts (new names, addresses, empty
``/dev/shm``): the launchers read the restart state from the durable tier, so the generation,
the restarts counted against ``jobMaxRetryCount`` and the job's first start go on, and the next
fault is restart 3 of 3, not 1 of 3.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster.hosts import Cluster
from tests.cluster.job import HostJob

pytestmark = pytest.mark.slow


def test_a_full_restart_on_new_hosts_keeps_the_restart_state(cluster: Cluster, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("jobMaxRetryCount: 3\nrestartPolicy:\n  numRestartBeforeFullJobRestart: 1\n"
                    "  evalPeriodSeconds: 3600\n  maxFullJobRestarts: 2\n")
    durable = tmp_path / "durable"
    h0, h1 = cluster.add_host(), cluster.add_host()
    # every step durable too: rank 1 exits at step 6 before saving it (local mode needs a common step)
    job = HostJob(cluster, tmp_path / "job", durable=f"file://{durable}", run_args=["--job", str(spec)],
                  train=["--steps", "200", "--fault", "exit", "--fault-step", "6", "--fault-generation", "-1",
                         "--durable-every", "1"])
    job.start([h0, h1])
    assert job.wait_exit(240, [h0.name, h1.name]) == {h0.name: 75, h1.name: 75}, job.report()
    first = job.state(h0)
    assert first["next_generation"] == 2 and first["full_restarts"] == 1 and first["restarts"] == 2, first
    # each host keeps its own first start (a fraction of a second apart); the durable copy is one of them
    started_at = {job.state(h)["job_started"] for h in (h0, h1)}
    h0.kill()
    h1.kill()
    h2, h3 = cluster.add_host(), cluster.add_host()  # new machines: nothing in their /dev/shm
    assert h2.run(["ls", "-A", "/dev/shm"]).stdout == "" and h3.run(["ls", "-A", "/dev/shm"]).stdout == ""
    job.train = ["--steps", "16", "--fault", "exit", "--fault-step", "12", "--fault-generation", "2",
                 "--durable-every", "1"]
    job.start([h2, h3])
    assert job.wait_exit(240, [h2.name, h3.name]) == {h2.name: 0, h3.name: 0}, job.report()
    for host in (h2, h3):
        ev = job.events(host.name)
        assert [e["generation"] for e in ev if e["event"] == "started"] == [2], ev
        restart = [e for e in ev if e["event"] == "restart"][-1]
        assert restart["generation"] == 3 and restart["why"] == "process restart 3 of 3", restart
        again = job.state(host)  # written at that restart, on the new host
        assert again["job_started"] in started_at and again["full_restarts"] == 1, (again, started_at)
        assert again["restarts"] == 3 and again["next_generation"] == 3, again
    resumed = job.resumed(0, 2)
    assert resumed is not None and resumed["step"] is not None and resumed["step"] >= 5, resumed
    assert "durable" in resumed["tiers"], resumed
