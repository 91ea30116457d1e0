"""One framed, authenticated socket: deadlines, per-frame tags, bulk bytes in tagged segments.

Call order: ``Connection(sock)`` → the handshake (``server.handshake`` / ``client.PeerClient.connect``)
with untagged frames → ``start_session(send_key, recv_key)`` → tagged ``send`` / ``recv`` and
``send_file`` / ``send_bytes`` / ``recv_into_file`` → ``close``. ``set_deadline`` bounds the
whole of an operation (a handshake, one request), not each ``recv``: a peer trickling a
byte now and then meets it all the same. Buffers grow with the bytes that arrived, never
with a length a peer announced.

A tag is HMAC-SHA256(direction key, sequence number | bytes): frames cannot be altered,
dropped, replayed or reordered by anyone on the path without the job secret. SHA-256 runs
at ~1.7 GB/s a core here (SHA extensions), and a segment is hashed while it is still in the
CPU cache next to the item checksum, so a replica still costs one pass over its bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
import select
import socket
import time
from typing import Any

from tierckpt.agent import protocol as p
from tierckpt.agent.transfer import StreamCheck

__all__ = ["Connection", "WriteFailed"]

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

    def _arm(self) -> None:
        timeout = self.step_timeout
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise p.ProtocolViolation("the operation ran past its deadline")
            timeout = min(timeout, left)
        self.sock.settimeout(timeout)

    def _tag(self, key: bytes, seq: int, *parts: bytes | memoryview) -> bytes:
        h = hmac.new(key, seq.to_bytes(8, "big"), hashlib.sha256)
        for part in parts:
            h.update(part)
        return h.digest()

    def _next_send_tag(self, *parts: bytes | memoryview) -> bytes:
        if self._send_key is None:
            return b""
        tag = self._tag(self._send_key, self._send_seq, *parts)
        self._send_seq += 1
        return tag

    def _check_tag(self, h: Any) -> None:
        """Read the tag that follows a frame or segment and compare it with ``h`` (an HMAC over it)."""
        got = self._exact(p.TAG)
        if not hmac.compare_digest(h.digest(), got):
            raise p.ProtocolViolation("a frame failed its authentication tag (altered on the way?)")
        self._recv_seq += 1

    def _recv_mac(self) -> Any:
        assert self._recv_key is not None
        return hmac.new(self._recv_key, self._recv_seq.to_bytes(8, "big"), hashlib.sha256)

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
            h = self._recv_mac()
            h.update(header)
            h.update(body)
            self._check_tag(h)
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
                h = self._recv_mac()
                h.update(piece)
                self._check_tag(h)
            out += piece
            left -= seg
        return bytes(out)

    # -- bulk bytes ---------------------------------------------------------------
    def send_bytes(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        for start in range(0, len(view), p.SEGMENT):
            seg = view[start : start + p.SEGMENT]
            self._arm()
            self.sock.sendall(seg)
            self.sock.sendall(self._next_send_tag(seg))

    def send_fd(self, fd: int, offset: int, length: int, check: StreamCheck | None = None) -> None:
        """``length`` bytes of an open file from ``offset``: each segment hashed (and its items checked
        by ``check``) from a read-only mapping, then sent with ``sendfile``, then its tag.

        A failed item check stops before the segment's tag goes out: the receiver can accept
        nothing of it. Raises IntegrityError then (the caller quarantines the copy).
        """
        if length == 0:
            return
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        with mmap.mmap(fd, offset + length - base, prot=mmap.PROT_READ, offset=base) as mm:
            view = memoryview(mm)
            try:
                pos = offset
                while pos < offset + length:
                    with view[pos - base : min(pos + p.SEGMENT, offset + length) - base] as seg:
                        if check is not None:
                            check.update(seg)
                            if check.error is not None:
                                break  # the segment's tag never goes out
                        tag = self._next_send_tag(seg)
                        n = len(seg)
                    self._sendfile(fd, pos, n)
                    self.sock.sendall(tag)
                    pos += n
                if check is not None:
                    check.finish()
            finally:
                view.release()

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
            h = self._recv_mac() if self._recv_key is not None else None
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
                self._check_tag(h)
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
