"""``hyperpodrun``'s command line under ``tierckpt run`` (issue 28 item 3): the job file of
docs/launcher.md, taken from the page, rendered and run unedited; the agent's HTTP API asked
with real requests while the job runs; ``JOB_RESTART_COUNT``; the SIGTERM stop
(``--shutdown-signal SIGTERM``, ``--stop-grace``'s path) seen by the worker it stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.launcher.cluster import alive
from tierckpt.testing.twonode import read_jsonl

pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[2] / "docs" / "launcher.md"
SCRIPT = """#!/bin/sh
echo "$(basename "$0") $* restart=$JOB_RESTART_COUNT group_rank=$GROUP_RANK" >> scripts.log
"""


def doc_job() -> dict[str, Any]:
    """The HyperPodPyTorchJob of docs/launcher.md's ``hyperpodrun`` section, as the page has it."""
    text = DOCS.read_text()
    section = text[text.index("## `hyperpodrun`'s command line"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None, "docs/launcher.md lost its hyperpodrun job file"
    return yaml.safe_load(block.group(1))


def _get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait(cond: Callable[[], Any], timeout: float, what: str, report: Callable[[], str]) -> Any:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for: {what}\n{report()}")


def test_the_docs_hyperpodrun_job_renders_and_runs_unedited(tmp_path: Path, shm: Callable[[str], str]) -> None:
    job = doc_job()
    container = job["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]
    command = [str(a) for a in container["command"]]
    assert command[0] == "hyperpodrun"
    port = int(next(a.split("=", 1)[1] for a in command if a.startswith("--server-port=")))
    if not _port_free(port):
        pytest.skip(f"port {port} (the doc's --server-port) is taken on this machine")
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))

    # renders as it is: every hyperpodrun option is one of tierckpt run's
    from tierckpt.cli import main as tierckpt_main

    out = tmp_path / "rendered.yaml"
    assert tierckpt_main(["k8s", "render", str(job_file), "-o", str(out)]) == 0
    rendered = [d for d in yaml.safe_load_all(out.read_text()) if d and d.get("kind") == "JobSet"][0]
    pod = rendered["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    argv = [str(a) for c in pod["containers"][:1] for a in (*c.get("command", []), *c.get("args", []))]
    for flag in ("--server-port=8080", "--shutdown-signal=SIGTERM", "--pre-train-script=./pre_train.sh",
                 "--post-train-script=./post_train.sh", "--pre-train-args=--stage data"):
        assert flag in argv, (flag, argv)

    # runs as it is: the image's scripts beside it, hyperpodrun -> tierckpt run
    for name in ("pre_train.sh", "post_train.sh"):
        (tmp_path / name).write_text(SCRIPT)
        (tmp_path / name).chmod(0o755 | stat.S_IEXEC)
    memory = shm("hp")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TIERCKPT_MEMORY_DIR=memory,
               TIERCKPT_NAMESPACE="hpdemo")
    log = open(tmp_path / "agent.log", "ab")  # noqa: SIM115 - the child owns it
    agent = subprocess.Popen([sys.executable, "-m", "tierckpt.cli", "run", f"--job={job_file}", *command[1:]],
                             cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    work = tmp_path / "work"

    def report() -> str:
        ev = "\n".join(json.dumps(e) for e in read_jsonl(tmp_path / "events.jsonl"))
        return f"events:\n{ev}\n--- agent log tail:\n" + "\n".join(
            (tmp_path / "agent.log").read_text(errors="replace").splitlines()[-30:])

    def trace(rank: int) -> list[dict[str, Any]]:
        return read_jsonl(work / f"trace_rank{rank}.jsonl")

    def steps(rank: int, generation: int) -> list[int]:
        return [e["step"] for e in trace(rank) if e["event"] == "step" and e["generation"] == generation]

    try:
        _wait(lambda: min(max(steps(r, 0), default=-1) for r in (0, 1)) >= 5, 120, "both ranks reach step 5", report)
        code, status = _get(port, "/status")
        assert code == 200 and status["state"] == "RUNNING" and status["restart_count"] == 0, status
        assert (status["nnodes"], status["world_size"], status["node"]) == (1, 2, 0), status
        assert _get(port, "/health") == (200, {"healthy": True, "state": "RUNNING"})
        assert _get(port, "/nothing")[0] == 404
        victim = int((work / "pid_rank1").read_text())
        survivor = int((work / "pid_rank0").read_text())
        os.kill(victim, signal.SIGKILL)
        resumed = {r: _wait(lambda r=r: next((e for e in trace(r) if e["event"] == "resumed"
                                              and e["generation"] == 1), None), 90, f"rank {r} resumes", report)
                   for r in (0, 1)}
        # the API while generation 1 runs: one restart, the fault's reason and node
        code, status = _wait(lambda: (lambda c_s: c_s if c_s[1]["state"] == "RUNNING" and c_s[1]["generation"] == 1
                                      else None)(_get(port, "/status")), 30, "/status says RUNNING in generation 1",
                             report)
        assert status["restart_count"] == 1 and status["restarts"] == {"process": 1}, status
        assert status["last_fault"]["reason"] == "Crash" and status["last_fault"]["node"] == 0, status
        assert status["last_fault"]["rank"] == 1, status
        assert _get(port, "/restart_count") == (200, {"restart_count": 1})
        assert {"INIT", "RUNNING", "FAULTED", "STOPPING"} <= set(status["transitions"]), status
        assert agent.wait(timeout=180) == 0, report()
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(timeout=30)

    events = read_jsonl(tmp_path / "events.jsonl")
    fault = next(e for e in events if e["event"] == "fault")
    assert (fault["reason"], fault["node"], fault["rank"], fault["generation"]) == ("Crash", 0, 1, 0), fault
    # the survivor was stopped by SIGTERM (--shutdown-signal SIGTERM), and it saw it
    sigterms = [e for e in trace(0) if e["event"] == "sigterm"]
    assert [(e["generation"], e["pid"], e["signal"]) for e in sigterms] == [(0, survivor, signal.SIGTERM)], sigterms
    assert not alive(survivor) and not alive(victim)
    # both resumed the same step, the weights saved at it, and saw JOB_RESTART_COUNT=1
    saved = {r: {e["step"]: e["digest"] for e in trace(r) if e["event"] == "step" and e["generation"] == 0}
             for r in (0, 1)}
    step = resumed[0]["step"]
    assert step is not None and step == resumed[1]["step"] and step >= 1, resumed
    for r in (0, 1):
        assert resumed[r]["digest"] == saved[r][step], "resumed state differs from the state saved at that step"
        assert resumed[r]["job_restart_count"] == 1 and resumed[r]["restart_count"] == 1, resumed[r]
        assert max(steps(r, 1)) == 60
    assert all(e["job_restart_count"] == 0 for r in (0, 1) for e in trace(r)
               if e["event"] == "start" and e["generation"] == 0)
    # the pre-train script at both starts, the post-train script once at the end, with their args
    assert (tmp_path / "scripts.log").read_text().splitlines() == [
        "pre_train.sh --stage data restart=0 group_rank=0",
        "pre_train.sh --stage data restart=1 group_rank=0",
        "post_train.sh --upload restart=1 group_rank=0",
    ]
    assert [(e["phase"], e["generation"]) for e in events if e["event"] == "script"] == [
        ("pre_train", 0), ("pre_train", 1), ("post_train", 1)]
    assert events[-1]["event"] == "exit" and events[-1]["code"] == 0
    # the launcher kept its rank file beside the workers' memory tier (TIERCKPT_MEMORY_DIR), not in the
    # default /dev/shm/tierckpt (where it was left behind before)
    assert [p.name for p in (Path(memory) / ".tierckpt-run").glob("*.rank.json")], list(Path(memory).rglob("*"))
