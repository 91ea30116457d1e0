"""One framed, authenticated socket: deadlines, per-frame tags, bulk bytes in tagged segments.

Call order: ``Connection(sock)`` → the handshake (``server.handshake`` / ``client.PeerClient.connect``)
with untagged frames → ``start_session(send_key, recv_key)`` → tagged ``send`` / ``recv`` and
``send_file`` / ``send_bytes`` / ``recv_into_file`` → ``close``. ``set_deadline`` bounds the
whole of an operation (a handshake, one request), not each ``recv``: a peer trickling a
byte now and then meets it all the same. Buffers grow with the bytes that arrived, never
with a length a peer announced.

A frame's tag is HMAC-SHA256(direction key, sequence number | frame); a bulk segment's is
HMAC-SHA256(direction key, sequence number | SHA-256(segment)): nothing can be altered,
dropped, replayed or reordered by anyone on the path without the job secret. The receiver
hashes each piece while it is still in the CPU cache, next to the item checksum (one pass
over the bytes); the sender hashes a file's segments once and keeps the digests
(``DigestCache``), so sending the same file to a second holder, or serving it again, costs
no hashing.
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
import select
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

from tierckpt.agent import protocol as p
from tierckpt.agent.transfer import StreamCheck

__all__ = ["Connection", "DigestCache", "WriteFailed"]

_GROW = 1 << 16  # bytes read at a time into a growing buffer
_PIECE = 1 << 20  # bulk bytes received at a time: fits the CPU cache for the two hashes


class WriteFailed(OSError):
    """Writing received bytes failed (ENOSPC, EFBIG, ...); every announced byte was still read."""


class Connection:
    """One framed socket; every read and write meets the current deadline (``set_deadline``)."""

    def __init__(self, sock: socket.socket, *, step_timeout: float = 120.0) -> None:
        self.sock = sock
        self.step_timeout = step_timeout
        self._deadline: float | None = None
        self._send_key: bytes | None = None
        self._recv_key: bytes | None = None
        self._send_seq = 0
        self._recv_seq = 0

    # -- session ------------------------------------------------------------------
    def start_session(self, send_key: bytes, recv_key: bytes) -> None:
        self._send_key, self._recv_key = send_key, recv_key

    def set_deadline(self, seconds: float | None) -> None:
        """Everything until the next call must finish within ``seconds`` (None: only ``step_timeout``)."""
        self._deadline = None if seconds is None else time.monotonic() + seconds
        self._arm()

    def wait_readable(self, seconds: float) -> bool:
        """Whether the peer sent something (or closed) within ``seconds``: the wait between requests."""
        return bool(select.select([self.sock], [], [], seconds)[0])

    def _arm(self) -> None:
        timeout = self.step_timeout
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the operation ran past its deadline")
            timeout = min(timeout, left)
        self.sock.settimeout(timeout)

    def _tag(self, key: bytes, seq: int, *parts: bytes | memoryview) -> bytes:
        h = hmac.new(key, seq.to_bytes(8, "big"), hashlib.sha256)
        for part in parts:
            h.update(part)
        return h.digest()

    def _next_send_tag(self, *parts: bytes | memoryview) -> bytes:
        """The tag of the next frame (over its bytes), or of the next bulk segment (over its SHA-256)."""
        if self._send_key is None:
            return b""
        tag = self._tag(self._send_key, self._send_seq, *parts)
        self._send_seq += 1
        return tag

    def _check_tag(self, *parts: bytes | memoryview) -> None:
        """Read the tag that follows a frame or segment and compare it with the one ``parts`` give."""
        if self._recv_key is None:
            raise p.ProtocolViolation("a tagged frame before the session started")
        expected = self._tag(self._recv_key, self._recv_seq, *parts)
        if not hmac.compare_digest(expected, self._exact(p.TAG)):
            raise p.ProtocolViolation("a frame failed its authentication tag (altered on the way?)")
        self._recv_seq += 1

    # -- frames -------------------------------------------------------------------
    def send(self, message: dict[str, Any]) -> None:
        frame = p.encode(message)
        self._arm()
        self.sock.sendall(frame + self._next_send_tag(frame))

    def recv(self) -> dict[str, Any]:
        header = self._exact(p.HEADER.size)
        length = p.parse_header(header)
        body = self._exact(length)
        if self._recv_key is not None:
            self._check_tag(header, body)
        return p.decode_body(body)

    def _exact(self, n: int) -> bytes:
        """Exactly ``n`` bytes; the buffer grows with what arrives (``n`` is often a peer's claim)."""
        buf = bytearray()
        while len(buf) < n:
            self._arm()
            chunk = self.sock.recv(min(n - len(buf), max(_GROW, len(buf))))
            if not chunk:
                raise p.ProtocolViolation(f"connection closed after {len(buf)} of {n} bytes")
            buf += chunk
        return bytes(buf)

    def recv_bytes(self, size: int) -> bytes:
        """``size`` bulk bytes (a small file) into memory, segment by segment, each tag checked."""
        out = bytearray()
        left = size
        while left:
            seg = min(left, p.SEGMENT)
            piece = self._exact(seg)
            if self._recv_key is not None:
                self._check_tag(hashlib.sha256(piece).digest())
            out += piece
            left -= seg
        return bytes(out)

    # -- bulk bytes ---------------------------------------------------------------
    def send_bytes(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        for start in range(0, len(view), p.SEGMENT):
            seg = view[start : start + p.SEGMENT]
            tag = self._next_send_tag(hashlib.sha256(seg).digest()) if self._send_key is not None else b""
            self._arm()
            self.sock.sendall(seg)
            self.sock.sendall(tag)

    def send_fd(self, fd: int, offset: int, length: int, check: StreamCheck | None = None,
                digests: DigestCache | None = None, identity: tuple[str, ...] | None = None) -> None:
        """``length`` bytes of an open file from ``offset``, each segment sent with ``sendfile`` and
        followed by its tag (an HMAC over the segment's SHA-256).

        The segment is hashed (and its items checked by ``check``) from a read-only mapping
        first, unless ``digests`` knows its SHA-256 already (the same unchanged file sent
        before: to another replica holder, or again) and nothing is to be checked. ``identity``
        names the file's contents (a committed step's save id and file name): without one
        ``digests`` is not used, because a memory-tier file's stat does not name its bytes (a
        shared-memory slot is reused by later saves, same inode, size and mtime, the bytes
        written through a mapping). A failed
        item check stops before the segment's tag goes out (the receiver can accept nothing
        of it) and raises IntegrityError (the caller quarantines the copy).
        """
        if length == 0:
            return
        if identity is None:
            digests = None
        size = os.fstat(fd).st_size
        segments = [(pos, min(p.SEGMENT, offset + length - pos)) for pos in range(offset, offset + length, p.SEGMENT)]
        keys = [(*(identity or ()), str(size), str(pos), str(n)) for pos, n in segments]
        known = [None if digests is None else digests.get(k) for k in keys]
        if check is None and all(d is not None for d in known):
            for (pos, n), digest in zip(segments, known, strict=True):
                self._send_segment(fd, pos, n, digest)
            return
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        with mmap.mmap(fd, offset + length - base, flags=flags, prot=mmap.PROT_READ, offset=base) as mm:
            view = memoryview(mm)
            try:
                for (pos, n), key, cached in zip(segments, keys, known, strict=True):
                    with view[pos - base : pos - base + n] as seg:
                        if check is not None:
                            check.update(seg)
                            if check.error is not None:
                                break  # the segment's tag never goes out
                        digest = cached or (hashlib.sha256(seg).digest() if self._send_key is not None else b"")
                    if digests is not None and digest and cached is None:
                        digests.put(key, digest)
                    self._send_segment(fd, pos, n, digest)
                if check is not None:
                    check.finish()
            finally:
                view.release()

    def _send_segment(self, fd: int, pos: int, n: int, digest: bytes | None) -> None:
        tag = self._next_send_tag(digest) if self._send_key is not None and digest else b""
        self._sendfile(fd, pos, n)
        if tag:
            self.sock.sendall(tag)

    def _sendfile(self, fd: int, offset: int, count: int) -> None:
        while count:
            self._arm()
            if not select.select([], [self.sock], [], self.sock.gettimeout())[1]:
                raise TimeoutError("the peer stopped reading")
            try:
                sent = os.sendfile(self.sock.fileno(), fd, offset, count)
            except BlockingIOError:
                continue  # a socket with a timeout is non-blocking underneath: wait again
            if sent == 0:
                raise p.ProtocolViolation(f"the file ended {count} bytes early while being sent")
            offset += sent
            count -= sent

    def recv_into_file(self, fd: int, size: int, check: StreamCheck | None = None, *, at: int | None = None) -> None:
        """Receive exactly ``size`` bulk bytes into ``fd`` (at its position, or at offset ``at``):
        one ``recv_into``, the item checksums and the tag's hash, one write per piece.

        A write that fails (ENOSPC, EFBIG) stops the writing but not the reading, so the
        connection stays in step for an error reply; it raises ``WriteFailed`` at the end.
        """
        buf = bytearray(min(_PIECE, max(size, 1)))
        view = memoryview(buf)
        left, failed = size, None
        while left:
            seg = min(left, p.SEGMENT)
            h = hashlib.sha256() if self._recv_key is not None else None
            got = 0
            while got < seg:  # each piece hashed twice and written while still in the CPU cache
                self._arm()
                k = self.sock.recv_into(view[: min(len(buf), seg - got)])
                if k == 0:
                    raise p.ProtocolViolation(f"connection closed with {left - got} bytes of a file still to come")
                piece = view[:k]
                if h is not None:
                    h.update(piece)
                if check is not None:
                    check.update(piece)
                if failed is None:
                    failed = _write_all(fd, piece, None if at is None else at + size - left + got)
                got += k
            if h is not None:
                self._check_tag(h.digest())
            left -= seg
        if failed is not None:
            raise WriteFailed(failed.errno, failed.strerror)
        if check is not None:
            check.finish()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class DigestCache:
    """SHA-256 digests of file segments, by (file identity, size, offset, length): a file sent
    again unchanged (to the next replica holder, to each restore) is not hashed again. The
    identity is the save's id and the file's name (a committed save's bytes never change), not
    its stat: memory-tier slots are reused by later saves with the same inode, size and mtime.
    Bounded; the oldest entries go first. One per agent; safe across its threads."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self._limit = limit
        self._d: OrderedDict[tuple[str, ...], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, ...]) -> bytes | None:
        with self._lock:
            return self._d.get(key)

    def put(self, key: tuple[str, ...], digest: bytes) -> None:
        with self._lock:
            self._d[key] = digest
            while len(self._d) > self._limit:
                self._d.popitem(last=False)


def _write_all(fd: int, piece: memoryview, at: int | None) -> OSError | None:
    """Write all of ``piece`` (``fd`` -1: drop it); the error instead of raising it."""
    if fd < 0:
        return None
    written = 0
    try:
        while written < len(piece):
            if at is None:
                written += os.write(fd, piece[written:])
            else:
                written += os.pwrite(fd, piece[written:], at + written)
    except OSError as exc:
        return exc
    return None
