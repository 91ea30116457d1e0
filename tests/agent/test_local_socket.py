"""The node socket ``<memory root>/.agent.sock`` has one owner: of several agents' listeners
started on one root at the same moment exactly one takes the name and the others get a typed
``AgentRunningError`` (before, the name was taken by ``rename``, which silently replaces
another listener's socket, so two agents could serve one root with one of them unreachable);
a socket left by a dead agent is taken over."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from tierckpt.agent.server import LocalServer
from tierckpt.errors import AgentRunningError
from tierckpt.node.sock import short_path


def _answers(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with short_path(path) as where:
            s.connect(where)
        return True
    except OSError:
        return False
    finally:
        s.close()


def test_of_listeners_started_at_once_on_one_root_exactly_one_serves(tmp_path: Path) -> None:
    path = tmp_path / ".agent.sock"
    for _ in range(5):
        gate = threading.Barrier(4)
        won: list[LocalServer] = []
        lost: list[BaseException] = []

        def start(gate: threading.Barrier = gate, won: list[LocalServer] = won,
                  lost: list[BaseException] = lost) -> None:
            gate.wait()
            try:
                won.append(LocalServer(path, handle_local=lambda *a: None, idle_s=1.0))  # type: ignore[arg-type,return-value]
            except BaseException as err:  # noqa: BLE001 - the test names what it expects below
                lost.append(err)

        threads = [threading.Thread(target=start) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        try:
            assert len(won) == 1 and len(lost) == 3, (won, lost)
            assert all(isinstance(e, AgentRunningError) for e in lost), lost
            assert _answers(path)
            assert [p.name for p in tmp_path.iterdir()] == [".agent.sock"]  # no private dirs left
        finally:
            for s in won:
                s.close()
        assert not path.exists()


def test_a_dead_agents_socket_is_taken_over(tmp_path: Path) -> None:
    path = tmp_path / ".agent.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the name stays, nobody listens
    assert path.exists() and not _answers(path)
    server = LocalServer(path, handle_local=lambda *a: None, idle_s=1.0)  # type: ignore[arg-type,return-value]
    try:
        assert _answers(path)
    finally:
        server.close()
