"""Answering a peer's ``list`` and ``get``: streamed listings, files verified before they go out.

Call order (in a peer connection's thread, after ``parse_request``): ``serve_list(state, req, conn)``
or ``serve_get(state, req, conn)``. A ``get`` opens the file without following any link,
checks the step's seal (and ``.metadata``'s checksum) before answering, then checks each
item of a data file as its bytes are mapped for sending: a copy that fails is refused (in
the middle of a file: the bad segment is replaced by an integrity error, ``wire.abort_bulk``),
and a replica that fails is quarantined (``NodeStore.quarantine``) so nobody is offered
it again. Nothing is created before the file is found; an own step's data file is pinned
(hard link in ``.pins``) for the send only, which the request's deadline bounds.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierckpt import layout
from tierckpt.agent import protocol as p
from tierckpt.agent import safefs
from tierckpt.agent.transfer import StreamCheck, verify_file
from tierckpt.agent.wire import Connection
from tierckpt.errors import IntegrityError
from tierckpt.observability import get_logger

if TYPE_CHECKING:
    from tierckpt.agent.state import NodeState

__all__ = ["listing_frames", "serve_get", "serve_list"]

_log = get_logger("agent")
_HOST = socket.gethostname()


def listing_frames(entries: list[dict[str, Any]], per_frame: int = p.MAX_LIST_NAMES) -> Iterator[dict[str, Any]]:
    """``listing`` frames of at most ``per_frame`` file names each; a large entry is split into
    pieces with the same (step, origin, save_id), which the client merges."""
    frame: list[dict[str, Any]] = []
    room = per_frame
    for e in entries:
        held, names = list(e["held"].items()), list(e["all"])
        while True:
            h, held = held[:room], held[room:]
            a, names = names[: room - len(h)], names[room - len(h) :]
            frame.append({**e, "held": dict(h), "all": a})
            room -= len(h) + len(a)
            if room <= 0:
                yield {"op": "listing", "steps": frame, "more": True}
                frame, room = [], per_frame
            if not held and not names:
                break
    yield {"op": "listing", "steps": frame, "more": False}


def serve_list(state: NodeState, req: p.ListSteps, conn: Connection) -> None:
    entries = []
    for h in state.store.holdings(req.namespace):
        held = {n: s for n, s in h.held.items() if _valid_name(n)}
        entries.append({"step": h.step, "origin": h.origin, "save_id": h.save_id, "held": held,
                        "all": list(h.all_files)})
    for frame in listing_frames(entries):
        conn.send(frame)


def _valid_name(name: str) -> bool:
    try:
        p.validate_file_name(name)
    except p.ProtocolViolation:
        return False
    return True


def serve_get(state: NodeState, req: p.Get, conn: Connection) -> None:
    store = state.store
    kind = store.kind_of(req.origin)
    where = f"{req.namespace}/step_{req.step}/{req.name}" + ("" if kind == "own" else f" (replica of {req.origin})")
    try:
        with safefs.open_dir(store.root, [*store.parts(kind, req.origin, req.namespace),
                                          layout.step_dir_name(req.step)]) as sfd:
            mf, _ = store.sealed(kind, req.origin, req.namespace, req.step)
            fd = safefs.open_file(sfd, req.name)
            pin = _pin(state, req, sfd) if kind == "own" and req.name not in p.SMALL_FILES else None
    except IntegrityError as exc:
        _refuse_bad(state, req, kind, conn, f"{where}: {exc}")
        return
    except OSError:
        conn.send({"op": "error", "message": f"{where} is not held here"})
        return
    try:
        _send_checked(state, req, kind, conn, fd, mf, where)
    finally:
        os.close(fd)
        if pin is not None:
            _unpin(state, req, pin)


def _send_checked(state: NodeState, req: p.Get, kind: str, conn: Connection, fd: int, mf: layout.Manifest,
                  where: str) -> None:
    size = os.fstat(fd).st_size
    length = size - req.offset if req.length is None else req.length
    if req.offset + length > size or length < 0:
        conn.send({"op": "error", "message": f"{req.name} has {size} bytes, not {req.offset}+{length}"})
        return
    if req.name in p.SMALL_FILES:
        data = os.pread(fd, size, 0) if size else b""
        if req.name == layout.METADATA and layout.checksum(data) != mf.metadata_xxh3:
            _refuse_bad(state, req, kind, conn, f"{where}: fails its checksum")
            return
        conn.send({"op": "file", "size": length})
        conn.send_bytes(data[req.offset : req.offset + length])
        return
    if mf.files.get(req.name) != size:
        _refuse_bad(state, req, kind, conn, f"{where}: {size} bytes, the manifest says {mf.files.get(req.name)}")
        return
    check = _range_check(mf, req.name, size, req.offset, length, where)
    if check is None:  # overlapping items cannot be checked in stream order: check the whole file first
        try:
            verify_file(_fd_path(fd), [r for r in mf.items if r.file == req.name], where)
        except IntegrityError as exc:
            _refuse_bad(state, req, kind, conn, str(exc))
            return
    conn.set_deadline(state.config.limits.bulk_s(length))
    conn.send({"op": "file", "size": length})
    try:
        conn.send_fd(fd, req.offset, length, check)
    except IntegrityError as exc:  # the requester was told instead of the bad segment (wire.abort_bulk)
        _quarantine(state, req, kind, str(exc))


def _range_check(mf: layout.Manifest, name: str, size: int, offset: int, length: int, where: str
                 ) -> StreamCheck | None:
    whole = StreamCheck.for_file(mf, name, size, where)
    if whole is None:
        return None
    inside = [r for r in whole.records if r.offset >= offset and r.offset + r.length <= offset + length]
    return StreamCheck(inside, where, start=offset)


def _refuse_bad(state: NodeState, req: p.Get, kind: str, conn: Connection, reason: str) -> None:
    _quarantine(state, req, kind, reason)
    conn.send({"op": "error", "message": f"refused: {reason}"})


def _quarantine(state: NodeState, req: p.Get, kind: str, reason: str) -> None:
    state.metrics.replicas_rejected.inc()
    if kind == "replica":
        state.store.quarantine(req.origin, req.namespace, req.step)
        _log.warning("[Agent %s] Step %d: quarantined the replica of %s from %s: %s", state.node_id, req.step,
                     req.namespace, req.origin, reason)
    else:
        _log.warning("[Agent %s] Step %d: refused to serve a damaged own copy: %s", state.node_id, req.step, reason)


def _pin(state: NodeState, req: p.Get, sfd: int) -> str | None:
    """A hard link of the data file in ``.pins`` (the trainer's slot stays busy while it is sent)."""
    pin = f"{layout.step_dir_name(req.step)}.{req.name}.owner-{_HOST}-{os.getpid()}.{uuid.uuid4().hex[:6]}"
    try:
        with safefs.open_dir(state.store.root, [req.namespace, layout.PINS], create=True) as pfd:
            os.link(req.name, pin, src_dir_fd=sfd, dst_dir_fd=pfd, follow_symlinks=False)
    except OSError:
        return None
    return pin


def _unpin(state: NodeState, req: p.Get, pin: str) -> None:
    try:
        with safefs.open_dir(state.store.root, [req.namespace, layout.PINS]) as pfd:
            os.unlink(pin, dir_fd=pfd)
    except OSError:
        pass


def _fd_path(fd: int) -> Path:
    return Path(f"/proc/self/fd/{fd}")  # the open file itself: no path lookup, no link followed
