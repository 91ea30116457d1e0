"""Receiving a replica from a peer: bounded by the node budget, staged, checked while it arrives, committed.

Call order (in a peer connection's thread, after ``parse_request`` gave a ``Put``):
``receive_replica(agent, req, conn, peer)`` reads every announced byte, then replies
``stored`` or ``error``; a replica that is not complete and verified never becomes visible.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tierckpt import layout
from tierckpt.agent import protocol as p
from tierckpt.agent.client import Connection
from tierckpt.agent.transfer import StreamCheck, verify_file
from tierckpt.errors import IntegrityError
from tierckpt.integrity import sealed_manifest_bytes
from tierckpt.observability import get_logger, throughput

if TYPE_CHECKING:
    from tierckpt.agent.service import Agent

__all__ = ["receive_replica"]

_log = get_logger("agent")


def receive_replica(agent: Agent, req: p.Put, conn: Connection, peer: str) -> None:
    """Store a replica a peer sends: budget, staging, every item checked, commit (marker last)."""
    if req.origin == agent.node_id or req.origin != peer:
        raise p.ProtocolViolation(f"node {peer} may only send its own steps")
    if any(n in p.SMALL_FILES and s > p.MAX_SMALL for n, s in req.files):
        raise p.ProtocolViolation("a metadata file larger than 64 MiB")
    if not agent.enforce_budget(req.nbytes):
        raise p.ProtocolViolation(f"no room for {req.nbytes} bytes within the node budget")
    tier = agent.store.replica(req.origin, req.namespace)
    staging = tier.staging_dir(req.step, req.save_id)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    (staging / f".owner-{socket.gethostname()}-{os.getpid()}").touch()
    t0 = time.perf_counter()
    try:
        small = _receive_files(req, conn, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if isinstance(small, IntegrityError):
        shutil.rmtree(staging, ignore_errors=True)
        agent.metrics.replicas_rejected.inc()
        conn.send({"op": "error", "message": f"replica rejected: {small}"})
        return
    tier.commit(req.step, req.save_id, {layout.METADATA: small[layout.METADATA],
                                        layout.MANIFEST: small[layout.MANIFEST]})
    for s in tier.list_steps():
        if s.step != req.step and s.step not in req.keep:
            tier.delete(s.step)  # the origin no longer holds it
    _log.info("[Agent %s] Step %d: stored a replica of %s from %s in %s", agent.node_id, req.step,
              req.namespace, req.origin, throughput(req.nbytes, time.perf_counter() - t0))
    conn.send({"op": "stored"})

def _receive_files(req: p.Put, conn: Connection, staging: Path) -> dict[str, bytes] | IntegrityError:
    """Every announced byte into ``staging``; the small files, or the reason the replica is bad.

    Data files that follow a sealed manifest are checked while they arrive (one pass);
    any that come before it are checked afterwards. Every announced byte is read either
    way, so the connection stays in step for the reply.
    """
    where = f"replica {req.namespace}/step_{req.step} from {req.origin}"
    small: dict[str, bytes] = {}
    manifest: layout.Manifest | None = None
    problem: IntegrityError | None = None
    unchecked: list[str] = []
    for name, size in req.files:
        if name in p.SMALL_FILES:
            small[name] = conn._exact(size)
            if manifest is None and problem is None and set(small) == set(p.SMALL_FILES):
                try:
                    manifest = _sealed_manifest(req, small, where)
                except IntegrityError as exc:
                    problem = exc
            continue
        check = None
        if manifest is not None and problem is None:
            try:
                if manifest.files.get(name) != size:
                    raise IntegrityError(f"{where}: {name} is not in the manifest with {size} bytes")
                check = StreamCheck.for_file(manifest, name, size, f"{where}/{name}")
            except IntegrityError as exc:
                problem = exc
        fd = os.open(staging / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            conn.recv_into_file(fd, size, check)
        except IntegrityError as exc:
            problem = problem or exc
        finally:
            os.close(fd)
        if check is None:
            unchecked.append(name)
    if problem is not None:
        return problem
    try:
        if manifest is None:
            manifest = _sealed_manifest(req, small, where)
        sizes = dict(req.files)
        for name in unchecked:
            if manifest.files.get(name) != sizes[name]:
                raise IntegrityError(f"{where}: {name} is not in the manifest with {sizes[name]} bytes")
            verify_file(staging / name, [r for r in manifest.items if r.file == name], f"{where}/{name}")
    except IntegrityError as exc:
        return exc
    return small

def _sealed_manifest(req: p.Put, small: dict[str, bytes], where: str) -> layout.Manifest:
    if set(small) != set(p.SMALL_FILES):
        raise IntegrityError("a replica needs .metadata, manifest.json and COMMITTED")
    mf = sealed_manifest_bytes(small[layout.MARKER], small[layout.MANIFEST], req.namespace, req.step, where=where,
                               save_id=req.save_id)
    if layout.checksum(small[layout.METADATA]) != mf.metadata_xxh3:
        raise IntegrityError(f"{where}: .metadata fails its checksum")
    return mf
