"""Fixtures for the node agent: fresh memory roots on /dev/shm and in-process agents, stopped after."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tierckpt import layout
from tierckpt.agent import AgentConfig, AgentHandle, start_agent


@pytest.fixture(autouse=True)
def private_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent given no secret makes this user's secret file under $HOME (``config.user_secret``):
    in a test, under a temporary home, never the real one."""
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))


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


def sends_ended(handle: AgentHandle, memory_dir: str, ns: str, to: Sequence[str] = ()) -> None:
    """Wait until the agent's replication of ``ns``'s newest step to ``to`` (node ids) has ended
    (``to`` empty: an agent that replicates nothing).

    A replica is visible on its target before the sender is done: after the target's answer it
    records the target, rewrites ``<ns>/.keep`` and drops its pins in ``<ns>/.pins``. A test that
    then removes ``<memory_dir>/<ns>`` races those writes (``rmtree`` fails with ENOTEMPTY, or
    on an entry gone meanwhile). Ended: every target recorded and no pin left; then one round
    (``tick``) so ``.keep`` is current and nothing more is written there.
    """
    pins = Path(memory_dir, ns, layout.PINS)

    def ended() -> bool:
        view = handle.status()["namespaces"].get(ns, {})
        done = view.get("replicated") or {"step": None, "to": []}
        newest = (view.get("steps") or [None])[-1] if to else done["step"]
        return (done["step"], done["to"]) == (newest, sorted(to)) and not (pins.exists() and any(pins.iterdir()))

    wait_for(ended, f"the replication of {ns} to {sorted(to) or 'nobody'} to end")
    handle.tick()


def lose_namespace(handle: AgentHandle, memory_dir: str, ns: str, to: Sequence[str] = ()) -> None:
    """The node loses ``ns`` from its memory tier while its agent keeps running (its socket stays),
    once the agent's replication of it to ``to`` has ended (``sends_ended``)."""
    sends_ended(handle, memory_dir, ns, to)
    shutil.rmtree(Path(memory_dir, ns))
