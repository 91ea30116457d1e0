"""The restart-state file (launcher/supervisor/runstate.py): written by several agents at once without a shared
temporary name (issue 24, item 3)."""

from __future__ import annotations

import json
import multiprocessing as mp
import traceback
from pathlib import Path

from tierckpt.launcher.options import RunOptions
from tierckpt.launcher.supervisor import runstate

_ROUNDS = 300


def _writer(memory_dir: str, who: int, go: object, errors: object) -> None:
    opts = RunOptions(memory_dir=memory_dir)
    go.wait()  # type: ignore[attr-defined]
    try:
        for i in range(_ROUNDS):
            runstate.save(opts, "job", {"next_generation": i, "writer": who})
    except Exception:
        errors.put(traceback.format_exc())  # type: ignore[attr-defined]


def test_agents_sharing_a_memory_dir_save_the_state_at_once(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    go, errors = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), who, go, errors)) for who in range(4)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(120)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert failures == [], failures[0]
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    final = json.loads((tmp_path / runstate.STATE_DIR / "job.json").read_text())
    assert final["next_generation"] == _ROUNDS - 1 and final["writer"] in range(4)
    assert runstate.load(RunOptions(memory_dir=str(tmp_path)), "job") == final
    leftovers = sorted(p.name for p in (tmp_path / runstate.STATE_DIR).iterdir() if p.name != "job.json")
    assert leftovers == []  # no temporary file left behind
