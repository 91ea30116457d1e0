"""Fixtures for the node agent: fresh memory roots on /dev/shm and in-process agents, stopped after."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tierckpt.agent import AgentConfig, AgentHandle, start_agent


@pytest.fixture
def node_dir() -> Iterator[Callable[[str], str]]:
    made: list[str] = []

    def make(tag: str = "node") -> str:
        path = tempfile.mkdtemp(prefix=f"tierckpt-agent-{tag}-", dir="/dev/shm")
        made.append(path)
        return path

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def agent() -> Iterator[Callable[..., AgentHandle]]:
    """``agent(memory_dir=..., node_id=..., peers=(...), ...)`` starts one; all are closed after."""
    started: list[AgentHandle] = []

    def start(**kw: Any) -> AgentHandle:
        kw.setdefault("scan_interval_s", 0.2)
        handle = start_agent(AgentConfig(**kw))
        started.append(handle)
        return handle

    yield start
    for h in started:
        h.close()


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    """Poll until ``predicate()`` is truthy (returning it); fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
