"""``workers/runner.Workers``, the supervisor's worker part, on real processes (no agent, no store).

The worker spec's rendezvous handler is a stand-in that only names the run: ``Workers`` reads
nothing else of it, and a real handler needs a rendezvous that this test does not exercise."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierckpt import workerenv
from tierckpt.launcher.events import Events
from tierckpt.launcher.workers.launch import static_env
from tierckpt.launcher.workers.runner import BEAT_PREFIX, Workers, remove_dead_beat_dirs
from tierckpt.launcher.workers.warm import WarmPolicy


class _Run:
    def get_run_id(self) -> str:
        return "runner-test"


def _group(script: Path, nproc: int) -> Any:
    from torch.distributed.elastic.agent.server.api import Worker, WorkerGroup, WorkerSpec

    spec = WorkerSpec(role="t", local_world_size=nproc, rdzv_handler=_Run(),  # type: ignore[arg-type]
                      entrypoint=sys.executable, args=("-u", str(script)))
    wg = WorkerGroup(spec)
    wg.group_rank, wg.group_world_size = 0, 1  # type: ignore[assignment]
    wg.workers = [Worker(local_rank=i, global_rank=i, role_rank=i, world_size=nproc, role_world_size=nproc)
                  for i in range(nproc)]
    return wg


_EVENTS: list[Events] = []


@pytest.fixture(autouse=True)
def _close_events() -> Iterator[None]:
    yield
    while _EVENTS:
        _EVENTS.pop().close()


def _workers(tmp: Path, stop_grace_s: float = 0.0) -> Workers:
    events = Events(str(tmp / "events.jsonl"), node=0, host="h")
    _EVENTS.append(events)
    return Workers(lambda beats: static_env(beats, namespace="ns", memory_dir=str(tmp / "mem")),
                   warm=WarmPolicy(workers=0), stop_grace_s=stop_grace_s, events=events)


def _start(w: Workers, wg: Any, tmp: Path, generation: int) -> dict[int, int]:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    seen: list[dict[int, dict[str, str]]] = []
    w.start(wg, generation=generation, addr="127.0.0.1", port=12345, extra={"EXTRA": str(generation)},
            set_local_rank_env=lambda env, lr: env.__setitem__("LOCAL_RANK", str(lr)),
            logs_specs=DefaultLogsSpecs(log_dir=str(tmp / f"logs{generation}"), redirects=Std.ALL),
            prefix_template=None, start_method="spawn", before=seen.append)
    assert len(seen) == 1 and set(seen[0]) == set(range(len(wg.workers))), "before() sees every rank's env"
    w.launched(wg)
    return w.pids()


def _out(w: Workers, lr: int, timeout: float = 60.0) -> str:
    assert w.ctx is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = Path(w.ctx.stdouts[lr]).read_text()
        if text.endswith("\n"):
            return text
        time.sleep(0.05)
    raise AssertionError(f"rank {lr} printed nothing")


def test_start_gives_each_rank_its_environment_and_stop_ends_them(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("import os, time\nprint(os.environ['RANK'], os.environ['TIERCKPT_GENERATION'], "
                      "os.environ['EXTRA'], os.environ['MASTER_PORT'], os.environ['TIERCKPT_MONITOR_DIR'], "
                      "os.environ['TIERCKPT_NAMESPACE'], flush=True)\ntime.sleep(600)\n")
    w, wg = _workers(tmp_path), _group(script, 2)
    try:
        beats = w.beat_dir
        Path(beats, "stale").write_text("x")
        pids = _start(w, wg, tmp_path, generation=3)
        assert not Path(beats, "stale").exists(), "a start empties the heartbeat folder"
        assert [wk.id for wk in wg.workers] == [pids[0], pids[1]]
        for lr in (0, 1):
            assert _out(w, lr).split() == [str(lr), "3", "3", "12345", beats, "ns"]
        assert w.replaceable() and w.warm_ranks == []
        w.stop()
        for pid in pids.values():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        w.stop()
        w.close()
    assert not Path(beats).exists(), "close removes the heartbeat folder"


def test_replace_restarts_one_rank_and_leaves_the_other(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("import os, time\nprint('run', os.environ.get('JOIN', '-'), flush=True)\ntime.sleep(600)\n")
    w, wg = _workers(tmp_path), _group(script, 2)
    try:
        first = _start(w, wg, tmp_path, generation=0)
        _out(w, 0)
        os.kill(first[0], 9)
        assert w.ctx is not None
        deadline = time.monotonic() + 30
        while w.ctx.wait(timeout=0.1) is None and time.monotonic() < deadline:
            pass
        pid, warm = w.replace(0, {"JOIN": "Crash"})
        assert pid != first[0] and not warm and w.pids() == {0: pid, 1: first[1]}
        os.kill(first[1], 0)  # the other rank still runs
        deadline = time.monotonic() + 60
        while "Crash" not in Path(w.ctx.stdouts[0]).read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert Path(w.ctx.stdouts[0]).read_text().split() == ["run", "-", "run", "Crash"]
    finally:
        w.stop()
        w.close()


def test_a_refill_without_a_pool_does_nothing_and_replace_needs_a_warm_context(tmp_path: Path) -> None:
    w = _workers(tmp_path)
    try:
        w.refill(0)
        assert w.workers_ready() and w.pool is None
        assert not Path(tmp_path / "events.jsonl").exists() or "standby" not in Path(tmp_path / "events.jsonl").read_text()
        with pytest.raises(RuntimeError, match="warm process context"):
            w.replace(0, {})
        w.stop()  # nothing started: nothing to stop
    finally:
        w.close()


def test_heartbeat_folders_of_dead_agents_go_and_live_ones_stay(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"{BEAT_PREFIX}{dead.pid}-abc"
    mine = tmp_path / f"{BEAT_PREFIX}{os.getpid()}-def"
    other = tmp_path / "unrelated-123"
    for d in (gone, mine, other):
        d.mkdir()
    remove_dead_beat_dirs(str(tmp_path))
    assert not gone.exists() and mine.exists() and other.exists()


def test_static_env_names_the_tiers_only_when_set(tmp_path: Path) -> None:
    env = static_env("/beats")
    assert env[workerenv.MONITOR_DIR] == "/beats" and workerenv.NAMESPACE not in env
    env = static_env("/beats", namespace="n", memory_dir="/m", durable_url="s3://b/p")
    assert (env[workerenv.NAMESPACE], env[workerenv.MEMORY_DIR], env[workerenv.DURABLE_URL]) == ("n", "/m", "s3://b/p")
