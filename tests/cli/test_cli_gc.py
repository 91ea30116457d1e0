"""gc: leftovers of dead saves go (only with --yes); committed steps and live processes' files stay."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer

from .conftest import NS, model_state

HOST = socket.gethostname()


@pytest.fixture
def live_pid() -> Iterator[int]:
    """A process that is alive for the whole test (it waits on its stdin), stopped by its PID after."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield proc.pid
    proc.kill()
    proc.wait()
    if proc.stdin is not None:
        proc.stdin.close()


@pytest.fixture
def dead_pid() -> int:
    """The PID of a process that has exited (and was reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(proc.stdout)


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def _leftovers(store, live_pid: int, dead_pid: int) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    mem, dur = store.memory_dir / NS, store.durable_dir / NS
    made = {
        "torn memory": mem / "step_7",
        "torn durable": dur / "step_8",
        "dead staging": dur / ".staging" / "step_9.deadbeef",
        "live staging": dur / ".staging" / "step_9.cafe",
        "other host staging": mem / ".staging" / "step_9.f00d",
        "trash": mem / ".trash" / "step_0.1234abcd",
    }
    for path in made.values():
        path.mkdir(parents=True)
        (path / "__0_0.distcp").write_bytes(b"x" * 100)
    (made["dead staging"] / f".owner-{HOST}-{dead_pid}").touch()
    (made["live staging"] / f".owner-{HOST}-{live_pid}").touch()
    (made["other host staging"] / f".owner-{HOST}x-{dead_pid}").touch()  # another host: cannot tell, so kept
    data = mem / "step_1" / "__0_0.distcp"
    made["dead pin"] = mem / ".pins" / f"step_1.__0_0.distcp.owner-{HOST}-{dead_pid}.abc123"
    made["dead pin"].parent.mkdir(parents=True, exist_ok=True)
    os.link(data, made["dead pin"])
    made["orphan slot"] = mem / ".slots" / "rank_0" / "slot_9"
    made["orphan slot"].write_bytes(b"\0" * 4096)
    return made


def test_gc_dry_run_lists_everything_and_changes_nothing(store, cli, live_pid, dead_pid) -> None:  # type: ignore[no-untyped-def]
    store.save(1, 2, durable=(1, 2))
    made = _leftovers(store, live_pid, dead_pid)
    before = _tree(store.memory_dir) | _tree(store.durable_dir)
    r = cli(*store.argv(), "gc")
    assert r.rc == 0, r.err
    assert _tree(store.memory_dir) | _tree(store.durable_dir) == before
    rows = {line.split()[-1] if "(" not in line else line.split("  (")[0].split()[-1]: line for line in r.out.splitlines()[:-1]}
    assert rows[str(made["torn memory"])].startswith("would delete memory   torn step")
    assert rows[str(made["torn durable"])].startswith("would delete durable  torn step")
    assert rows[str(made["dead staging"])].startswith("would delete durable  dead staging")
    assert rows[str(made["live staging"])].startswith("keep") and f"in use by {HOST}-{live_pid}" in rows[str(made["live staging"])]
    assert rows[str(made["other host staging"])].startswith("keep")
    assert rows[str(made["dead pin"])].startswith("would delete memory   dead pin")
    assert rows[str(made["trash"])].startswith("would delete memory   trash")
    assert rows[str(made["orphan slot"])].startswith("keep") and "younger than --min-age" in rows[str(made["orphan slot"])]
    assert re.fullmatch(r"dry run: 5 item\(s\), [\d.]+ \w+; run again with --yes to delete", r.out.splitlines()[-1])
    assert not any(str(store.memory_step(s)) in r.out or str(store.durable_step(s)) in r.out for s in (1, 2))


def test_gc_yes_deletes_the_leftovers_and_keeps_every_committed_step(store, cli, live_pid, dead_pid) -> None:  # type: ignore[no-untyped-def]
    store.save(1, 2, durable=(1, 2))
    committed = {p: _tree(p) for p in (store.memory_step(1), store.memory_step(2), store.durable_step(1), store.durable_step(2))}
    made = _leftovers(store, live_pid, dead_pid)
    r = cli(*store.argv(), "gc", "--yes", "--min-age", "0")
    assert r.rc == 0, r.err
    gone = {"torn memory", "torn durable", "dead staging", "trash", "dead pin", "orphan slot"}
    assert {k for k, p in made.items() if not p.exists()} == gone
    assert re.search(r"^deleted 6 item\(s\)", r.out, re.M)
    assert "gc: 100%" in r.err
    for path, files in committed.items():
        assert _tree(path) == files, path
    assert (store.memory_step(1) / "__0_0.distcp").stat().st_nlink == 2  # the step and its slot: the pin is gone
    assert cli(*store.argv(), "ls", "--verify").rc == 0
    with Checkpointer(store.config()) as ck:
        target = model_state(0)
        assert ck.load(target, step=2) == 2
    want = model_state(2)
    for group in ("model", "optim"):
        for key, tensor in want[group].items():
            assert torch.equal(target[group][key].view(torch.uint8), tensor.view(torch.uint8)), key
    again = cli(*store.argv(), "gc", "--yes", "--min-age", "0")
    assert again.rc == 0 and f"nothing to delete in namespace '{NS}'" in again.out


def test_gc_keeps_a_free_slot_that_a_running_saver_maps(store, cli) -> None:  # type: ignore[no-untyped-def]
    with Checkpointer(store.config(memory_steps_retained=1)) as ck:
        ck.save(1, model_state(1)).result(60)
        ck.save(2, model_state(2)).result(60)  # step 1 goes: its slot is free, still mapped by this process
        slots = sorted((store.memory_dir / NS / ".slots" / "rank_0").iterdir())
        free = [s for s in slots if s.stat().st_nlink == 1]
        assert free, "retention should have freed a slot"
        r = cli(*store.argv(durable=False), "gc", "--yes", "--min-age", "0")
        assert r.rc == 0
        for slot in free:
            assert slot.exists()
            assert re.search(rf"^keep .* orphan slot .*{slot}  \(mapped by a running process\)$", r.out, re.M)
        ck.save(3, model_state(3)).result(60)  # the saver still has its slots
    assert cli(*store.argv(durable=False), "verify", "3").rc == 0
