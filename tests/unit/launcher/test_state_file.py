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


def test_the_run_state_is_a_typed_value_with_the_files_keys_and_tolerates_damage() -> None:
    from tierckpt.launcher.supervisor.runstate import RunState

    raw = {"next_generation": 5, "full_restarts": 1, "job_started": 1_700_000_000.25,
           "hang": {"longest_s": 2.0, "longest_idle_s": 0.5, "intervals": 9}, "restarts": 4, "resume_before": 8,
           "membership_changes": 2, "offenses": {"h:/m": [1.0]}, "avoid": [{"identity": "h:/m"}],
           "unhealthy_before": 3, "full_restart_at": 1_700_000_100.5}
    st = RunState.from_dict(raw)
    assert (st.next_generation, st.full_restarts, st.restarts, st.resume_before) == (5, 1, 4, 8)
    assert st.full_restart_at == 1_700_000_100.5  # the next incarnation's downtime starts there
    assert st.to_dict() == raw and list(st.to_dict()) == list(raw)  # the keys, in the order files have them
    assert RunState.from_dict({}) == RunState() and RunState().to_dict()["job_started"] is None
    bad = RunState.from_dict({"next_generation": "7", "full_restarts": -1, "job_started": float("nan"),
                              "hang": [1], "resume_before": True, "avoid": "x", "unhealthy_before": 2.5,
                              "full_restart_at": "soon"})
    assert bad == RunState(), bad  # malformed fields read as their defaults, never as an error
