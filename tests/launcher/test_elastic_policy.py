"""``elasticPolicy.replicaDiscreteValues`` at run time (issue 28 item 4): a job that may run on 1
or 3 nodes loses one of its 3; the 2 survivors are a count it may not run on, so one survivor
goes on alone (regroup) and the other stands by; the lost machine comes back and the job grows
to 3 again. At no time does a generation run on 2 nodes. The job file is docs/launcher.md's."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.launcher.cluster import LocalJob

pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[2] / "docs" / "launcher.md"
RANKS = (0, 1, 2)


def doc_job() -> str:
    """The elastic job file of docs/launcher.md ("Allowed node counts"), its text as the page has it."""
    text = DOCS.read_text()
    section = text[text.index("*Allowed node counts.*"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None, "docs/launcher.md lost its elastic job file"
    lines = block.group(1).splitlines()
    indent = min(len(ln) - len(ln.lstrip()) for ln in lines if ln.strip())
    return "\n".join(ln[indent:] for ln in lines) + "\n"


def _steps(job: LocalJob, rank: int) -> dict[int, dict[int, str]]:
    out: dict[int, dict[int, str]] = {}
    for e in job.trace(rank):
        if e["event"] == "step":
            out.setdefault(e["generation"], {})[e["step"]] = e["digest"]
    return out


def test_a_lost_node_never_leaves_the_job_on_a_forbidden_count(tmp_path: Path,
                                                               make_job: Callable[..., LocalJob]) -> None:
    text = doc_job()
    assert yaml.safe_load(text)["spec"]["elasticPolicy"]["replicaDiscreteValues"] == [1, 3]
    job_file = tmp_path / "elastic.yaml"
    job_file.write_text(text)
    steps = 400
    # 3 ranks' shards resumed by one rank: node 0 holds one peer's replica, so the others come from
    # the durable tier (a step every other one; global mode reshards 3 -> 1 -> 3)
    job = make_job(nnodes=3, nnodes_arg="1:3", job_file=job_file, durable=f"file://{tmp_path}/durable",
                   train=["--steps", str(steps), "--global-mode", "--durable-every", "2"])
    job.start()
    job.wait_for(lambda: min(job.last_step(r) for r in RANKS) >= 8, 180, "the three ranks reach step 8")
    job.wait_for(lambda: any((tmp_path / "durable").rglob("COMMITTED")), 60, "a durable step")
    job.kill_machine(2)

    # node 0 regroups alone (1 node), node 1 stands by: 2 is not an allowed count
    shrunk = job.wait_for(lambda: next((e for e in job.events(0) if e["event"] == "membership"), None), 90,
                          "node 0 regroups")
    assert (shrunk["via"], shrunk["nnodes"], shrunk["nnodes_before"]) == ("regroup", 1, 3), shrunk
    g1 = int(shrunk["generation"])
    surplus = job.wait_for(lambda: next((e for e in job.events(1) if e["event"] == "spare"
                                         and e.get("state") == "surplus"), None), 30, "node 1 stands by")
    assert surplus["keep"] == 1 and "[1, 3]" in surplus["why"], surplus
    for n in (0, 1):  # every node blames the lost machine
        fault = next(e for e in job.events(n) if e["event"] == "fault")
        assert (fault["reason"], fault["node"]) == ("LostNode", 2), fault
    resumed = job.wait_for(lambda: job.resumed(0, g1), 90, "rank 0 resumes alone")
    assert resumed["world"] == 1 and resumed["step"] is not None, resumed
    assert resumed["digest"] == _steps(job, 0)[0][resumed["step"]]  # the weights saved at that step, bit for bit
    job.wait_for(lambda: job.last_step(0, generation=g1) >= resumed["step"] + 5, 60, "5 steps alone")
    assert job.last_step(1, generation=g1) == -1  # the surplus node did not train meanwhile

    job.start_agent(2)  # the machine is back: 1 running + 2 waiting = 3, an allowed count
    grown = job.wait_for(lambda: next((e for e in job.events(0) if e["event"] == "restart"
                                       and e["generation"] > g1), None), 120, "the job grows to 3 nodes")
    assert grown["reason"] == "MembershipChange" and "no restart counted" in grown["why"], grown
    g2 = int(grown["generation"])
    assert job.wait_exit(300) == {0: 0, 1: 0, 2: 0}, job.report()

    # never on 2 nodes: every round, every started generation, every resumed world is 1 or 3
    worlds: set[Any] = {e["nnodes"] for n in RANKS for e in job.events(n) if e["event"] in ("membership", "started")}
    worlds |= {e["world"] for r in RANKS for e in job.trace(r) if e["event"] == "resumed"}
    assert worlds <= {1, 3}, worlds
    assert all(job.last_step(1, generation=g) == -1 for g in range(g1, g2))
    both = [job.resumed(r, g2) for r in RANKS]
    assert all(b is not None and b["world"] == 3 for b in both), both
    assert len({b["step"] for b in both if b}) == 1 and len({b["digest"] for b in both if b}) == 1, both
    assert all(job.last_step(r, generation=g2) == steps for r in RANKS)
