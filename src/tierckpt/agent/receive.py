"""Receiving a replica from a peer: admitted, reserved, staged per connection, checked, committed.

Call order (in a peer connection's thread, after ``parse_request`` gave a ``Put``):
``receive_replica(state, req, conn, peer)``:

1. refuse before any byte moves (``error``): another node's steps, a put of the same
   origin/step already in flight, a committed step owned by another sender's token, no room
   (the bytes are *reserved* against the node budget, or against the filesystem's free
   space when no budget is set; eviction is only counted on, not done). The same save
   already committed under this sender's token: ``held``, nothing to send.
2. the step is protected in this node's own memory (``agent.protect``: a put in flight counts);
   ``ready`` → every announced byte into this connection's own staging directory (0700,
   files 0600, no link followed), each data item checked while it arrives.
3. a write that fails (ENOSPC, EFBIG) or a replica that fails its checks: every announced
   byte is still read, then an ``error`` frame says what failed; the staging directory goes.
4. otherwise evict what the budget now needs, record the owner, one rename makes the step
   visible, steps of this origin the sender no longer keeps (and owns) go; ``stored``; the
   protected steps follow the replicas now held (``protect.refresh`` after ``NodeState.end_put``).
"""

from __future__ import annotations

import errno
import os
import socket
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from tierckpt import layout
from tierckpt.agent import protocol as p
from tierckpt.agent import safefs
from tierckpt.agent.protect import refresh as refresh_protected
from tierckpt.agent.store import Held, owner_hash
from tierckpt.agent.transfer import StreamCheck, verify_file
from tierckpt.agent.wire import Connection, WriteFailed
from tierckpt.errors import IntegrityError
from tierckpt.observability import get_logger, throughput
from tierckpt.tiers.integrity import sealed_manifest_bytes

if TYPE_CHECKING:
    from tierckpt.agent.state import NodeState

__all__ = ["receive_replica"]

_log = get_logger("agent")
_HOST = socket.gethostname()


def receive_replica(state: NodeState, req: p.Put, conn: Connection, peer: str) -> None:
    """Store a replica a peer sends (see the module docstring for the order)."""
    if req.origin == state.node_id or req.origin != peer:
        raise p.ProtocolViolation(f"node {peer} may only send its own steps")
    if any(n in p.SMALL_FILES and s > p.MAX_SMALL for n, s in req.files):
        raise p.ProtocolViolation("a metadata file larger than 64 MiB")
    key = (req.origin, req.namespace, req.step)
    if not state.begin_put(key):
        conn.send({"op": "error", "message": f"a put of {req.namespace}/step_{req.step} from {req.origin} "
                                              "is in flight already; refused"})
        return
    reserved = 0
    try:
        refusal = _refusal(state, req)
        if refusal is None:
            refusal = state.reserve(req.nbytes)
            reserved = 0 if refusal else req.nbytes
        if refusal == "held":
            reply = {"op": "held"}
        elif refusal:
            reply = {"op": "error", "message": refusal}
        else:
            refresh_protected(state)  # this step stays in this node's own memory before its bytes come
            reply = _stage_and_commit(state, req, conn)
    finally:
        state.release(reserved)
        state.end_put(key)
        refresh_protected(state)  # the protected steps follow the replicas now held
    conn.send(reply)  # once the claim is released: the sender may put again at once


def _refusal(state: NodeState, req: p.Put) -> str | None:
    """Why this put cannot go ahead ("held": the same save is here already), or None."""
    store = state.store
    name = layout.step_dir_name(req.step)
    where = f"{req.namespace}/{name} from {req.origin}"
    if state.restoring():  # the link's bandwidth goes to the restore first (agent.prefetch)
        return f"{where}: this node is restoring its state from peers; the next round sends it"
    if not os.path.lexists(store.root.joinpath(*store.parts("replica", req.origin, req.namespace), name)):
        return None
    recorded = store.owner_of(req.origin, req.namespace, req.step)
    if recorded != owner_hash(req.owner):
        return f"{where} is held for another sender (its owner token differs); refused"
    try:
        mf, _ = store.sealed("replica", req.origin, req.namespace, req.step)
    except (OSError, IntegrityError):
        return None  # a damaged copy: the owner may replace it
    return "held" if mf.save_id == req.save_id else None


def _stage_and_commit(state: NodeState, req: p.Put, conn: Connection) -> dict[str, str]:
    """This connection's own staging directory (a link on the way: ``error`` before ``ready``), the
    bytes, the checks, the commit; the staging directory is gone afterwards whatever happened."""
    parts = state.store.parts("replica", req.origin, req.namespace)
    staging = f"{layout.staging_dir_name(req.step, req.save_id)}.{uuid.uuid4().hex[:12]}"
    t0 = time.perf_counter()
    ready = False  # after ``ready`` the peer is sending: an OSError then ends the connection
    try:
        with safefs.open_dir(state.store.root, [*parts, layout.STAGING], create=True) as stage_root:
            os.mkdir(staging, 0o700, dir_fd=stage_root)
            try:
                with safefs.open_dir(state.store.root, [*parts, layout.STAGING, staging]) as sfd:
                    _touch(sfd, f".owner-{_HOST}-{os.getpid()}")
                    ready = True
                    conn.send({"op": "ready"})
                    conn.set_deadline(state.config.limits.bulk_s(req.nbytes))
                    problem = _receive_files(req, conn, sfd) or _commit(state, req, stage_root, staging, sfd)
            finally:
                safefs.remove_entry(stage_root, staging)  # gone after a commit: nothing to do
    except OSError as exc:
        if ready:
            raise
        return {"op": "error", "message": f"cannot stage a replica of {req.namespace}/step_{req.step} from "
                                          f"{req.origin}: {_describe(exc)}"}
    if problem is not None:
        return {"op": "error", "message": problem}
    _drop_unkept(state, req)
    _log.info("[Agent %s] Step %d: stored a replica of %s from %s in %s", state.node_id, req.step,
              req.namespace, req.origin, throughput(req.nbytes, time.perf_counter() - t0))
    return {"op": "stored"}


def _receive_files(req: p.Put, conn: Connection, sfd: int) -> str | None:
    """Every announced byte (small files into memory, data files into ``sfd``); what went wrong, or None.

    Data files that follow a sealed manifest are checked while they arrive (one pass);
    any that come before it are checked afterwards. Every announced byte is read whatever
    fails, so the connection stays in step for the reply.
    """
    where = f"replica {req.namespace}/step_{req.step} from {req.origin}"
    small: dict[str, bytes] = {}
    manifest: layout.Manifest | None = None
    problem: str | None = None
    unchecked: list[str] = []
    for name, size in req.files:
        if name in p.SMALL_FILES:
            small[name] = conn.recv_bytes(size)
            if manifest is None and problem is None and set(small) == set(p.SMALL_FILES):
                try:
                    manifest = _sealed_manifest(req, small, where)
                except IntegrityError as exc:
                    problem = f"replica rejected: {exc}"
            continue
        check = None
        if manifest is not None and problem is None:
            try:
                if manifest.files.get(name) != size:
                    raise IntegrityError(f"{where}: {name} is not in the manifest with {size} bytes")
                check = StreamCheck.for_file(manifest, name, size, f"{where}/{name}")
            except IntegrityError as exc:
                problem = f"replica rejected: {exc}"
        problem = _receive_data(conn, sfd, name, size, check, problem, where) or problem
        if check is None:
            unchecked.append(name)
    if problem is not None:
        return problem
    try:
        if manifest is None:
            manifest = _sealed_manifest(req, small, where)
        _verify_afterwards(req, manifest, sfd, unchecked, where)
        for name in (layout.METADATA, layout.MANIFEST, layout.MARKER):  # the marker last
            _write_small(sfd, name, small[name])
    except IntegrityError as exc:
        return f"replica rejected: {exc}"
    except OSError as exc:
        return f"replica {where} not stored: writing its small files failed: {_describe(exc)}"
    return None


def _receive_data(conn: Connection, sfd: int, name: str, size: int, check: StreamCheck | None,
                  problem: str | None, where: str) -> str | None:
    """One data file into the staging directory (or, after a failure, read and dropped)."""
    fd = -1
    try:
        if problem is None:
            fd = safefs.open_file(sfd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        conn.recv_into_file(fd, size, None if problem else check)
    except IntegrityError as exc:
        return f"replica rejected: {exc}"
    except WriteFailed as exc:
        return f"replica {where} not stored: writing {name} failed after the bytes arrived: {_describe(exc)}"
    finally:
        if fd >= 0:
            os.close(fd)
    return None


def _verify_afterwards(req: p.Put, manifest: layout.Manifest, sfd: int, unchecked: list[str], where: str) -> None:
    sizes = dict(req.files)
    for name in unchecked:
        if manifest.files.get(name) != sizes[name]:
            raise IntegrityError(f"{where}: {name} is not in the manifest with {sizes[name]} bytes")
        verify_file(Path(f"/proc/self/fd/{sfd}") / name, [r for r in manifest.items if r.file == name],
                    f"{where}/{name}")


def _commit(state: NodeState, req: p.Put, stage_root: int, staging: str, sfd: int) -> str | None:
    """Evict for the bytes now here, record the owner, one rename; an error message or None."""
    store = state.store
    name = layout.step_dir_name(req.step)
    try:
        state.settle()
        store.set_owner(req.origin, req.namespace, req.step, req.owner)
        os.unlink(f".owner-{_HOST}-{os.getpid()}", dir_fd=sfd)  # a committed step holds the step's files only
        with safefs.open_dir(store.root, store.parts("replica", req.origin, req.namespace)) as nfd:
            if os.path.lexists(f"/proc/self/fd/{nfd}/{name}"):
                safefs.remove_entry(nfd, name)  # an older save of this step, same owner (checked)
            os.rename(staging, name, src_dir_fd=stage_root, dst_dir_fd=nfd)
    except OSError as exc:
        return f"replica {req.namespace}/{name} from {req.origin} not stored: commit failed: {_describe(exc)}"
    return None


def _drop_unkept(state: NodeState, req: p.Put) -> None:
    """Steps of this origin the sender no longer keeps: deleted, if this sender owns them."""
    store = state.store
    mine = owner_hash(req.owner)
    for s in store.replica(req.origin, req.namespace).list_steps():
        if s.step != req.step and s.step not in req.keep and store.owner_of(req.origin, req.namespace, s.step) == mine:
            store.delete(Held("replica", req.namespace, req.origin, s.step, 0, 0.0))


def _sealed_manifest(req: p.Put, small: dict[str, bytes], where: str) -> layout.Manifest:
    if set(small) != set(p.SMALL_FILES):
        raise IntegrityError("a replica needs .metadata, manifest.json and COMMITTED")
    mf = sealed_manifest_bytes(small[layout.MARKER], small[layout.MANIFEST], req.namespace, req.step, where=where,
                               save_id=req.save_id)
    if layout.checksum(small[layout.METADATA]) != mf.metadata_xxh3:
        raise IntegrityError(f"{where}: .metadata fails its checksum")
    try:
        for name in mf.files:
            p.validate_file_name(name)
    except p.ProtocolViolation as exc:
        raise IntegrityError(f"{where}: the manifest names a file that is not a checkpoint file: {exc}") from None
    return mf


def _write_small(sfd: int, name: str, data: bytes) -> None:
    fd = safefs.open_file(sfd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _touch(sfd: int, name: str) -> None:
    os.close(safefs.open_file(sfd, name, os.O_WRONLY | os.O_CREAT))


def _describe(exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno or 0, "")
    return f"{code} {exc.strerror or exc}".strip()
