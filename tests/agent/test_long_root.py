"""An agent whose memory root is deep in a tree (its socket path beyond sun_path's 108 bytes)
starts, and the library reaches it: commit notices and requests go through."""

from __future__ import annotations

import os
from pathlib import Path

from tierckpt.node.sock import agent_socket, notify_committed
from tierckpt.tiers.peer import local_request


def test_agent_with_a_deep_memory_root_serves_local_requests(node_dir, agent) -> None:
    root = Path(node_dir("deep"), "a" * 40, "b" * 40)
    root.mkdir(parents=True)
    assert len(os.fsencode(agent_socket(root))) > 108
    agent(memory_dir=str(root), node_id="node-deep")
    assert local_request(root, {"op": "budget"})["ok"] is True
    assert notify_committed(root, "deep-ns", 1)
