"""The peer tier: other nodes' memory tiers and the replicas they hold, reached through the node agent.

A training process never talks to other nodes itself. When a node agent runs, it listens on
``<memory root>/.agent.sock``; this module is the library's whole view of it:

- ``notify_committed`` (``node/sock.py``): after each memory commit, tell the agent.
- ``PeerTier``: a read-only tier for loads. ``catalog()`` asks the agent which steps and files
  its peers hold (their own memory steps and the replicas they keep, its own replicas too);
  ``read_file`` / ``map_file`` ask the agent to fetch one file, verified against the step's
  manifest, into ``<memory root>/.peer/<namespace>/step_<N>/`` and then read it from there.

Local wire format: one JSON object per line each way, one request per connection.
Call order (a reader, one load): ``open_peer`` → ``catalog`` once → ``read_file`` /
``map_file`` for what the memory tier lacks, before the durable tier is tried.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierckpt import layout
from tierckpt.errors import CheckpointNotFoundError, IntegrityError, StorageError
from tierckpt.node.sock import agent_socket, short_path
from tierckpt.tiers.base import Source, StepListing
from tierckpt.tiers.local import LocalTier

__all__ = ["PeerStep", "PeerTier", "local_request", "open_peer"]

MAX_LINE = 4 << 20


def local_request(memory_dir: str | os.PathLike[str], message: Mapping[str, Any], *,
                  timeout: float = 60.0) -> dict[str, Any]:
    """One request to this node's agent and its reply; StorageError when it cannot be reached."""
    path = agent_socket(memory_dir)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        with short_path(path) as where:
            s.connect(where)
        s.sendall(json.dumps(dict(message)).encode() + b"\n")
        buf = bytearray()
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            buf += chunk
            if len(buf) > MAX_LINE:
                raise StorageError(f"the agent at {path} sent an oversized reply")
        reply = json.loads(buf) if buf else None
    except (OSError, ValueError) as exc:
        if isinstance(exc, StorageError):
            raise
        raise StorageError(f"the node agent at {path} could not be reached: {exc}", tier="peer") from exc
    finally:
        s.close()
    if not isinstance(reply, dict):
        raise StorageError(f"the node agent at {path} closed the connection without a reply", tier="peer")
    return reply


@dataclass(frozen=True)
class PeerStep:
    """One step as the job's other nodes hold it: files reachable (name → size), and every file."""

    step: int
    held: Mapping[str, int]
    all_files: frozenset[str] = field(default_factory=frozenset)


class PeerTier:
    """Read-only: files of other nodes' memory tiers and of replicas, fetched by the node agent."""

    name = "peer"

    def __init__(self, memory_dir: str, namespace: str, *, timeout: float = 300.0) -> None:
        self.memory_dir = memory_dir
        self.namespace = namespace
        self.timeout = timeout
        self.cache = LocalTier(Path(memory_dir) / layout.PEER_CACHE, namespace, name="peer", durable=False)
        self._fetched: set[tuple[int, str]] = set()

    def location(self, step: int | None = None) -> str:
        where = f"peers of {self.memory_dir}/{self.namespace}"
        return where if step is None else f"{where}/{layout.step_dir_name(step)}"

    def catalog(self) -> dict[int, PeerStep]:
        reply = local_request(self.memory_dir, {"op": "catalog", "ns": self.namespace}, timeout=self.timeout)
        if not reply.get("ok"):
            raise StorageError(f"the node agent could not list peers: {reply.get('error')}", tier="peer")
        out: dict[int, PeerStep] = {}
        for entry in reply.get("steps", []):
            step = layout.validate_step(int(entry["step"]))
            out[step] = PeerStep(step, {str(k): int(v) for k, v in entry["held"].items()},
                                 frozenset(str(n) for n in entry.get("all", [])))
        return out

    def list_steps(self, *, include_uncommitted: bool = False) -> list[StepListing]:
        return [StepListing(s.step, True, dict(s.held)) for _, s in sorted(self.catalog().items())]

    def fetch(self, step: int, name: str) -> Path:
        """Have the agent place a verified copy of the file in the peer cache; its path."""
        if (step, name) not in self._fetched:
            reply = local_request(self.memory_dir, {"op": "fetch", "ns": self.namespace, "step": step, "name": name},
                                  timeout=self.timeout)
            if not reply.get("ok"):
                kind = reply.get("kind")
                msg = f"{self.location(step)}/{name}: {reply.get('error')}"
                if kind == "missing":
                    raise CheckpointNotFoundError(msg, tier="peer", step=step)
                if kind == "integrity":
                    raise IntegrityError(msg, tier="peer", step=step)
                raise StorageError(msg, tier="peer", step=step)
            self._fetched.add((step, name))
        return self.cache.step_dir(step) / name

    def read_file(self, step: int, name: str) -> bytes:
        self.fetch(step, name)
        return self.cache.read_file(step, name)

    def read_range(self, step: int, name: str, offset: int, length: int) -> memoryview:
        self.fetch(step, name)
        return self.cache.read_range(step, name, offset, length)

    def map_file(self, step: int, name: str) -> memoryview:
        self.fetch(step, name)
        return self.cache.map_file(step, name)

    def put_file(self, step: int, save_id: str, name: str, source: Source) -> None:
        raise StorageError("the peer tier is read-only (the node agent writes replicas)", tier="peer")

    def commit(self, step: int, save_id: str, files: Mapping[str, bytes]) -> None:
        raise StorageError("the peer tier is read-only (the node agent writes replicas)", tier="peer")

    def delete(self, step: int) -> None:
        raise StorageError("the peer tier is read-only (the node agent evicts replicas)", tier="peer")


def open_peer(memory_dir: str, namespace: str) -> PeerTier | None:
    """The peer tier when this node runs an agent (its socket exists), else None."""
    return PeerTier(memory_dir, namespace) if agent_socket(memory_dir).exists() else None
