"""The launcher's prefetch hook (launcher/dataplane/prefetch.py): events around a hosted agent's prefetch, and
the switch that turns it off. A real in-process agent on loopback with no peers: nothing to fetch."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from tierckpt.agent import AgentConfig, start_agent
from tierckpt.launcher.dataplane import prefetch
from tierckpt.launcher.events import Events


def test_enabled_unless_turned_off() -> None:
    assert prefetch.enabled({})
    assert prefetch.enabled({prefetch.ENV: "1"})
    for off in ("0", "false", "OFF", " no "):
        assert not prefetch.enabled({prefetch.ENV: off})


def test_start_emits_started_then_done_and_needs_an_agent_a_namespace_and_ranks(tmp_path: Path) -> None:
    events = Events(str(tmp_path / "events.jsonl"), node=1)
    root = tempfile.mkdtemp(prefix="tierckpt-hook-", dir="/dev/shm")
    agent = start_agent(AgentConfig(memory_dir=root, listen=("127.0.0.1", 0), secret=b"s"))
    try:
        assert prefetch.start(None, "ns", [1], events, 0) is None
        assert prefetch.start(agent, None, [1], events, 0) is None
        assert prefetch.start(agent, "ns", [], events, 0) is None
        job = prefetch.start(agent, "ns", [1], events, 3)
        assert job is not None and job.wait(30) and job.ok and job.results == {}
        events.close()
        recs = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
        assert [(r["event"], r["phase"], r["generation"]) for r in recs] == [("prefetch", "started", 3),
                                                                             ("prefetch", "done", 3)]
        assert recs[0]["ranks"] == [1] and recs[1]["ok"] is True and recs[1]["bytes"] == 0
    finally:
        agent.close()
        shutil.rmtree(root, ignore_errors=True)
