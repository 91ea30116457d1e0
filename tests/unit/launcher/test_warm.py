"""Standby interpreters (``tierckpt.launcher.workers.warm`` / ``standby``) on real processes, without an agent.

A standby becomes the worker it is handed: output on the given descriptors, the environment,
argv and cwd of the rank, the script's exit code, torch imported and CUDA untouched. A stale
one (a module it imported changed on disk) runs the command cold in place; a dead one is
passed over for a cold start; one whose agent went away exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tierckpt.launcher.workers.warm import Standby, StandbyPool, WarmPolicy, WarmSubprocessContext, warmable

SCRIPT = """
import json, os, sys
torch = sys.modules.get("torch")
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(), "name": __name__,
                  "warm": os.environ.get("TIERCKPT_WARM"), "rank": os.environ.get("RANK"),
                  "torch_preloaded": torch is not None,
                  "cuda_initialized": bool(torch is not None and torch.cuda.is_initialized())}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def _env(tmp: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(tmp), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path)


def _wait_ready(sb: Standby, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not sb.ready():
        assert sb.alive(), f"standby exited with {sb.proc.returncode}"
        assert time.monotonic() < deadline, "standby never finished its imports"
        time.sleep(0.05)


def _hand(sb: Standby, tmp: Path, script: Path, code: int, extra: dict[str, str]) -> tuple[dict[str, object], str]:
    out, err = tmp / "out.txt", tmp / "err.txt"
    with open(out, "w") as fo, open(err, "w") as fe:
        sb.hand_over(("-u", str(script), str(code)), {**sb.env, **extra}, fo.fileno(), fe.fileno())
    assert sb.proc.wait(timeout=120) == code
    return json.loads(out.read_text().splitlines()[-1]), err.read_text()


def test_warmable_commands() -> None:
    py = sys.executable
    assert warmable(py, ("-u", "-m", "pkg.train", "--lr", "1"))
    assert warmable(py, ("-u", "train.py"))
    assert warmable("/usr/bin/python3.11", ("-u", "train.py"))
    assert not warmable(py, ("-u", "-m"))  # no module
    assert not warmable(py, ("-u", "-X", "dev", "train.py"))  # interpreter flags: cold
    assert not warmable(py, ("train.py",))  # no -u: not torchrun's command line
    assert not warmable("/opt/job/train.sh", ("-u", "x.py"))  # --no-python


@pytest.fixture
def standby() -> Iterator[Callable[..., Standby]]:
    """Standby factory; each is retired (killed with its process group) after the test, pass or fail."""
    made: list[Standby] = []

    def make(*args: Any, **kw: Any) -> Standby:
        made.append(Standby(*args, **kw))
        return made[-1]

    yield make
    for sb in made:
        sb.retire()


@pytest.mark.slow
def test_standby_becomes_the_worker(tmp_path: Path, standby: Callable[..., Standby]) -> None:
    """Also: a warm interpreter never initialises CUDA (torch preloaded, CUDA untouched)."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    sb = standby(sys.executable, (), _env(tmp_path))
    _wait_ready(sb)
    pid = sb.pid
    got, err = _hand(sb, tmp_path, script, 7, {"RANK": "3"})
    assert got == {"argv": [str(script), "7"], "cwd": os.getcwd(), "pid": pid, "name": "__main__", "warm": "1",
                   "rank": "3", "torch_preloaded": True, "cuda_initialized": False}
    assert err.strip() == "to stderr"


@pytest.mark.slow
def test_stale_standby_runs_the_command_cold_in_place(tmp_path: Path, standby: Callable[..., Standby]) -> None:
    (tmp_path / "usermod.py").write_text("VALUE = 1\n")
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    sb = standby(sys.executable, ("usermod",), _env(tmp_path))
    _wait_ready(sb)
    st = os.stat(tmp_path / "usermod.py")
    os.utime(tmp_path / "usermod.py", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the code changed
    pid = sb.pid
    got, err = _hand(sb, tmp_path, script, 0, {"RANK": "0"})
    assert got["pid"] == pid and got["warm"] == "0" and got["torch_preloaded"] is False  # a fresh interpreter
    assert "usermod.py changed" in err


@pytest.mark.slow
def test_dead_standby_falls_back_to_a_cold_start(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    pool = StandbyPool(WarmPolicy(workers=1), sys.executable, _env(tmp_path))
    pool.fill()
    (sb,) = pool._idle
    os.killpg(sb.pid, 9)
    sb.proc.wait(timeout=30)
    ctx = WarmSubprocessContext(pool=pool, name="t", entrypoint=sys.executable, args={0: ("-u", str(script), "0")},
                                envs={0: {"RANK": "0"}},
                                logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), redirects=Std.ALL))
    try:
        ctx.start()
        assert ctx.warm_ranks == []
        result = None
        deadline = time.monotonic() + 120
        while result is None and time.monotonic() < deadline:
            result = ctx.wait(timeout=1)
        assert result is not None and not result.is_failed()
        got = json.loads(Path(ctx.stdouts[0]).read_text().splitlines()[-1])
        assert got["warm"] is None and got["pid"] != sb.pid
    finally:
        ctx.close()
    assert pool.died == [(sb.pid, -9)]  # noticed and dropped; the agent reports it and starts a new one
    try:
        assert pool.short and pool.fill() == 1 and not pool.short
    finally:
        pool.close()


@pytest.mark.slow
def test_standby_exits_when_its_agent_goes_away(tmp_path: Path, standby: Callable[..., Standby]) -> None:
    sb = standby(sys.executable, (), _env(tmp_path))
    sb.sock.close()  # what the agent's death does to its end
    assert sb.proc.wait(timeout=120) == 0


@pytest.mark.parametrize(
    "argv, workers, imports",
    [([], 2, ()), (["--warm-workers", "0"], 0, ()), (["--no-warm"], 0, ()), (["--warm-workers", "5"], 5, ()),
     (["--warm-imports", "transformers, mypkg.models"], 2, ("transformers", "mypkg.models"))],
)
def test_run_options(argv: list[str], workers: int, imports: tuple[str, ...]) -> None:
    from tierckpt.launcher.cli import _options, build_parser

    args = build_parser().parse_args(["--nproc-per-node", "2", *argv, "train.py"])
    # as many spares again, for a fault right after a restart
    assert _options(args).warm == WarmPolicy(workers=workers, spare=workers, imports=imports)


def test_warm_loader_options_reach_the_standbys_with_the_scripts_argv() -> None:
    from tierckpt.launcher.cli import _options, build_parser
    from tierckpt.launcher.workers.warm import script_argv

    args = build_parser().parse_args(["--warm-loader", "train:make_loader", "--warm-loader", "pkg.data:build",
                                      "train.py", "--lr", "1"])
    assert _options(args).warm.loaders == ("train:make_loader", "pkg.data:build")
    assert script_argv(("-u", "train.py", "--lr", "1")) == ["train.py", "--lr", "1"]
    assert script_argv(("-u", "-m", "pkg.train", "--lr", "1")) == ["pkg.train", "--lr", "1"]
    pool = StandbyPool(WarmPolicy(workers=1, loaders=("train:make_loader",)), sys.executable, {},
                       script_args=("-u", "train.py", "--data", "/d"))
    assert json.loads(pool.loaders) == {"loaders": ["train:make_loader"], "argv": ["train.py", "--data", "/d"]}


@pytest.mark.parametrize("argv, match", [(["--warm-workers", "many"], "--warm-workers must be 'auto' or a count"),
                                         (["--warm-workers", "-1"], "--warm-workers must be 0 or more"),
                                         (["--warm-imports", "a b"], "'a b' is not a module name"),
                                         (["--warm-loader", "train.make_loader"], "MODULE:FUNCTION")])
def test_bad_run_options(argv: list[str], match: str) -> None:
    from tierckpt.errors import TierckptError
    from tierckpt.launcher.cli import _options, build_parser

    with pytest.raises(TierckptError, match=match):
        _options(build_parser().parse_args([*argv, "train.py"]))


POLICY_SCRIPT = """
import json, os
tids = os.listdir("/proc/self/task")
print(json.dumps({"policies": sorted({os.sched_getscheduler(int(t)) for t in tids}), "threads": len(tids)}))
"""


def _policy(pid: int) -> int:
    """The scheduling policy of ``pid``'s main thread (field 41 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[38])


@pytest.mark.slow
def test_a_spare_imports_at_idle_priority_and_works_at_normal(tmp_path: Path) -> None:
    """Replacements spawned right after a restart must not take CPU from it (SCHED_IDLE), and the
    worker one becomes must not stay idle-priority (every thread back to SCHED_OTHER)."""
    script = tmp_path / "policy.py"
    script.write_text(POLICY_SCRIPT)
    pool = StandbyPool(WarmPolicy(workers=1, spare=1), sys.executable, _env(tmp_path))
    try:
        assert pool.fill() == 2
        normal, spare = pool._idle
        assert (normal.idle, spare.idle) == (False, True)
        assert (_policy(normal.pid), _policy(spare.pid)) == (os.SCHED_OTHER, os.SCHED_IDLE)
        # handed a rank while still importing (a fault right after a restart, on a busy node):
        # it must not finish its imports at idle priority
        pool._idle.remove(spare)
        assert not spare.ready()  # torch takes seconds to import
        out, err = tmp_path / "out.txt", tmp_path / "err.txt"
        with open(out, "w") as fo, open(err, "w") as fe:
            spare.hand_over(("-u", str(script)), dict(spare.env), fo.fileno(), fe.fileno())
        with contextlib.suppress(FileNotFoundError):
            assert _policy(spare.pid) == os.SCHED_OTHER
        assert spare.proc.wait(timeout=120) == 0, err.read_text()
        got = json.loads(out.read_text().splitlines()[-1])
        assert got["policies"] == [os.SCHED_OTHER], got
        _wait_ready(normal)
        assert _policy(normal.pid) == os.SCHED_OTHER
        assert pool.short and pool.fill(idle=True) == 1 and pool._idle[-1].idle  # its replacement: idle
    finally:
        pool.close()


@pytest.mark.slow
def test_a_failed_rank_leaves_the_others_running_and_is_replaced_alone(tmp_path: Path) -> None:
    """The context reports a dead rank without stopping the other (the agent decides); ``replace``
    starts that rank again alone, its output appended to the rank's log, and the job then succeeds."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    script = tmp_path / "job.py"
    script.write_text("import os, sys, time\nprint('run', os.environ.get('GO'), flush=True)\n"
                      "time.sleep(float(sys.argv[1]))\n")
    ctx = WarmSubprocessContext(pool=None, name="t", entrypoint=sys.executable,
                                args={0: ("-u", str(script), "600"), 1: ("-u", str(script), "8")},
                                envs={0: {"GO": "first"}, 1: {"GO": "first"}},
                                logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), redirects=Std.ALL))
    try:
        ctx.start()
        first = ctx.pids()
        deadline = time.monotonic() + 60
        while "run" not in Path(ctx.stdouts[0]).read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(first[0], 9)
        result = None
        while result is None and time.monotonic() < deadline:
            result = ctx.wait(timeout=0.2)
        assert result is not None and result.is_failed() and set(result.failures) == {0}
        assert ctx.subprocess_handlers[1].proc.poll() is None, "the other rank must keep running"
        ctx.args[0] = ("-u", str(script), "0")  # the replacement runs to the end at once
        pid, warm = ctx.replace(0, {"GO": "again"})
        assert pid != first[0] and not warm and ctx.pids() == {0: pid, 1: first[1]}
        result = None
        deadline = time.monotonic() + 60
        while result is None and time.monotonic() < deadline:
            result = ctx.wait(timeout=0.2)
        assert result is not None and not result.is_failed(), result
        assert Path(ctx.stdouts[0]).read_text().split() == ["run", "first", "run", "again"], "appended, not truncated"
    finally:
        ctx.close()


LOADER_FACTORY = """
import sys
from tierckpt.data import ResumableLoader
from tierckpt.testing.files import FileDataset

def make_loader(rank, world_size):
    root = sys.argv[sys.argv.index("--data") + 1]
    return ResumableLoader(FileDataset(root), batch_size=4, seed=3, rank=rank, world_size=world_size, num_workers=2)
"""

LOADER_SCRIPT = """
import itertools, json, os, sys
import tierckpt.data as td
from loaderfactory import make_loader
loader = td.ahead(make_loader)
report = td.prewarm.last()
pids = loader.worker_pids()
batches = [x.numpy().tobytes().hex() + y.numpy().tobytes().hex() for x, y in itertools.islice(iter(loader), 5)]
print(json.dumps({"warm": report.warm, "why": report.why, "pids": pids, "rank": loader.rank,
                  "policies": sorted({os.sched_getscheduler(p) for p in pids}), "batches": batches}))
"""


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return out


def _sockets(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:"):
                out.add(link)
    return out


@pytest.mark.slow
def test_a_standby_builds_the_data_loader_ahead_and_the_script_takes_it(
        tmp_path: Path, standby: Callable[..., Standby]) -> None:
    """``--warm-loader``: the standby (a spare, at SCHED_IDLE) builds the factory's loader with the
    script's argv and forks its workers before the rank is known; the script's
    ``tierckpt.data.ahead`` takes that loader bound to its rank (same worker processes, back at
    SCHED_OTHER) and reads exactly the batches a loader built cold reads. The workers do not hold
    the standby's socket to its agent."""
    from tierckpt.data import ResumableLoader
    from tierckpt.testing.files import FileDataset, write_samples

    data = tmp_path / "samples"
    write_samples(data, 40)
    (tmp_path / "loaderfactory.py").write_text(LOADER_FACTORY)
    script = tmp_path / "job.py"
    script.write_text(LOADER_SCRIPT)
    argv = [str(script), "--data", str(data)]
    sb = standby(sys.executable, (), _env(tmp_path), idle=True, loaders=json.dumps({"loaders": ["loaderfactory:make_loader"], "argv": argv}))
    _wait_ready(sb)
    deadline = time.monotonic() + 30
    while len(workers := _children(sb.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(workers) == 2, workers
    assert {_policy(w) for w in workers} == {os.SCHED_IDLE}  # forked by a spare: idle until it serves
    agent_socket = {os.readlink(f"/proc/{sb.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{sb.pid}/fd")
                    if os.readlink(f"/proc/{sb.pid}/fd/{fd}").startswith("socket:")}
    while any(_sockets(w) & agent_socket for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)  # the workers close it as they start (worker_init_fn)
    assert not any(_sockets(w) & agent_socket for w in workers)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as fo, open(err, "w") as fe:
        sb.hand_over(("-u", *argv), {**sb.env, "RANK": "1", "WORLD_SIZE": "2"}, fo.fileno(), fe.fileno())
    assert sb.proc.wait(timeout=120) == 0, err.read_text()
    got = json.loads(out.read_text().splitlines()[-1])
    assert got["warm"] is True and got["rank"] == 1 and sorted(got["pids"]) == sorted(workers), got
    assert got["policies"] == [os.SCHED_OTHER]
    cold = ResumableLoader(FileDataset(data), batch_size=4, seed=3, rank=1, world_size=2)
    want = [x.numpy().tobytes().hex() + y.numpy().tobytes().hex() for x, y in list(iter(cold))[:5]]
    assert got["batches"] == want


@pytest.mark.slow
def test_a_warm_loader_factory_that_needs_the_rank_is_built_cold_by_the_script(
        tmp_path: Path, standby: Callable[..., Standby]) -> None:
    data = tmp_path / "samples"
    from tierckpt.testing.files import write_samples

    write_samples(data, 40)
    (tmp_path / "loaderfactory.py").write_text(LOADER_FACTORY.replace("seed=3,", "seed=3 + rank % world_size,"))
    script = tmp_path / "job.py"
    script.write_text(LOADER_SCRIPT)
    argv = [str(script), "--data", str(data)]
    sb = standby(sys.executable, (), _env(tmp_path), loaders=json.dumps({"loaders": ["loaderfactory:make_loader"], "argv": argv}))
    _wait_ready(sb)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as fo, open(err, "w") as fe:
        sb.hand_over(("-u", *argv), {**sb.env, "RANK": "0", "WORLD_SIZE": "2"}, fo.fileno(), fe.fileno())
    assert sb.proc.wait(timeout=120) == 0, err.read_text()
    got = json.loads(out.read_text().splitlines()[-1])
    assert got["warm"] is False and len(got["batches"]) == 5, got
    assert "could not build it: loaderfactory:make_loader: TypeError" in got["why"], got
