"""Stable group ranks (pure ``assign`` and the round-store exchange), the replication default of
``tierckpt run`` on several nodes, and the reaper that stops workers when their agent dies."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierckpt.launcher.cli import _agent_config, build_parser
from tierckpt.launcher.membership import ranks
from tierckpt.launcher.membership.ranks import Claim, assign
from tierckpt.launcher.workers.reaper import Reaper, start_time


def test_assign_keeps_prior_ranks_against_torch_order() -> None:
    # torch ordered the survivor (held 1) first and the relaunched node (remembers 0) second
    assert assign([Claim(prior=1, survivor=True), Claim(prior=0)]) == [1, 0]


def test_assign_survivor_wins_a_conflict_and_the_rest_fill_in_order() -> None:
    assert assign([Claim(prior=0), Claim(prior=0, survivor=True), Claim(prior=None)]) == [1, 0, 2]


def test_assign_ignores_ranks_beyond_a_smaller_job() -> None:
    assert assign([Claim(prior=3), Claim(prior=None)]) == [0, 1]
    assert sorted(assign([Claim(prior=None)] * 4)) == [0, 1, 2, 3]


def test_prior_rank_kept_beside_the_memory_tier(tmp_path: Path) -> None:
    assert ranks.load_prior(str(tmp_path), "job") is None
    assert ranks.save_prior(str(tmp_path), "job", 3, 4) is None
    assert ranks.load_prior(str(tmp_path), "job") == 3


def _args(*extra: str) -> object:
    return build_parser().parse_args([*extra, "train.py"])


def test_several_nodes_without_a_durable_tier_replicate_by_default() -> None:
    cfg = _args("--nnodes", "2", "--memory-dir", "/dev/shm/x")
    assert _agent_config(cfg).replicas == 1  # type: ignore[arg-type]
    assert _agent_config(_args("--nnodes", "1:4", "--memory-dir", "/dev/shm/x")).replicas == 1  # type: ignore[arg-type]
    assert _agent_config(_args("--nnodes", "1", "--memory-dir", "/dev/shm/x")) is None  # type: ignore[arg-type]
    assert _agent_config(_args("--nnodes", "2", "--memory-dir", "/dev/shm/x",  # type: ignore[arg-type]
                               "--durable-url", "file:///tmp/d")) is None


def test_replicas_zero_opts_out_with_one_warning_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert _agent_config(_args("--nnodes", "2", "--replicas", "0", "--memory-dir", "/dev/shm/x")) is None  # type: ignore[arg-type]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a lost node loses the steps only its memory tier held" in err[0]


def test_help_states_the_replication_default() -> None:
    text = " ".join(build_parser().format_help().split())
    assert "Default: 1 when --nnodes is more than 1 and there is no --durable-url" in text


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_reaper_kills_the_workers_when_its_agent_dies(tmp_path: Path) -> None:
    """The 'agent' is a child process that forks the reaper and is then SIGKILLed."""
    events = tmp_path / "events.jsonl"
    worker = _sleeper()
    code = (f"import os, time\nfrom tierckpt.launcher.workers.reaper import Reaper\nr = Reaper.fork()\n"
            f"r.update(generation=0, node=1, events={str(events)!r})\nr.watch([{worker.pid}])\n"
            "print(r.pid, flush=True)\ntime.sleep(60)\n")
    agent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert agent.stdout is not None
        reaper_pid = int(agent.stdout.readline())
        t0 = time.monotonic()
        agent.kill()
        agent.wait()
        while worker.poll() is None and time.monotonic() - t0 < 3:
            time.sleep(0.01)
        assert worker.poll() is not None, "the reaper did not stop the worker"
        assert time.monotonic() - t0 < 1.0
        deadline = time.monotonic() + 3
        while not _gone(reaper_pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        line = events.read_text()
        assert '"LostNode"' in line and "no claim" in line  # no store was given
    finally:
        for p in (agent, worker):
            if p.poll() is None:
                p.kill()
                p.wait()
        if agent.stdout is not None:
            agent.stdout.close()


def test_reaper_close_claims_nothing_and_leaves_no_child(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    reaper = Reaper.fork()
    reaper.update(generation=0, node=0, events=str(events))
    reaper.close()
    assert not events.exists()
    with pytest.raises(ChildProcessError):
        os.waitpid(reaper.pid, os.WNOHANG)


def test_start_time_names_a_process_once() -> None:
    assert start_time(os.getpid()) is not None
    assert start_time(2**22 + 7) is None
