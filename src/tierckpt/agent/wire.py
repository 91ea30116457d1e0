"""One framed socket, TLS 1.3 or (on a fabric the user trusts) plain: deadlines, frames, bulk bytes.

Call order: ``Connection(sock)`` → the handshake (``server.PeerServer`` / ``client.PeerClient.connect``:
the plaintext hello, then ``start_tls`` on both ends unless the wire is insecure, then the
MACs) → ``send`` / ``recv`` and ``send_fd`` / ``send_bytes`` / ``recv_into_file`` → ``close``.
``set_deadline`` bounds the whole of an operation (a handshake, one request), not each
``recv``: a peer trickling a byte now and then meets it all the same. Buffers grow with the
bytes that arrived, never with a length a peer announced.

Integrity, confidentiality, replay and reordering protection are TLS's (``agent.tls``), not
this module's. Bulk bytes go in segments of at most ``SEGMENT`` bytes, each preceded by one
byte: ``SEG_DATA`` (the segment follows) or ``SEG_ABORT`` (an ``error`` frame follows
instead: the sender found the bytes it was about to send damaged, and says so; the
connection stays in step). Plain sockets send file bytes with ``sendfile``; a TLS socket
encrypts them from a read-only mapping of the file.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import ssl
import time
from typing import Any

from tierckpt.agent import protocol as p
from tierckpt.agent.transfer import StreamCheck
from tierckpt.errors import IntegrityError

__all__ = ["Connection", "SEG_ABORT", "SEG_DATA", "WriteFailed"]

_GROW = 1 << 16  # bytes read at a time into a growing buffer
_PIECE = 1 << 20  # bulk bytes received at a time: fits the CPU cache for the item checksums
_TLS_WRITE = 256 << 10  # bytes per TLS write: 8 MiB at once cost 2.8x the CPU per GB here (cache misses)
SEG_DATA, SEG_ABORT = b"\x00", b"\x01"


class WriteFailed(OSError):
    """Writing received bytes failed (ENOSPC, EFBIG, ...); every announced byte was still read."""


class Connection:
    """One framed socket; every read and write meets the current deadline (``set_deadline``)."""

    def __init__(self, sock: socket.socket, *, step_timeout: float = 120.0) -> None:
        self.sock = sock
        self.step_timeout = step_timeout
        self._deadline: float | None = None

    @property
    def tls(self) -> bool:
        return isinstance(self.sock, ssl.SSLSocket)

    def start_tls(self, wrap: Any) -> None:
        """Replace the socket by ``wrap(sock)`` (a TLS handshake, under the current deadline)."""
        self._arm()
        self.sock = wrap(self.sock)

    def set_deadline(self, seconds: float | None) -> None:
        """Everything until the next call must finish within ``seconds`` (None: only ``step_timeout``)."""
        self._deadline = None if seconds is None else time.monotonic() + seconds
        self._arm()

    def wait_readable(self, seconds: float) -> bool:
        """Whether the peer sent something (or closed) within ``seconds``: the wait between requests."""
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return True  # decrypted bytes already wait inside the TLS layer
        return bool(select.select([self.sock], [], [], seconds)[0])

    def _arm(self) -> None:
        timeout = self.step_timeout
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the operation ran past its deadline")
            timeout = min(timeout, left)
        self.sock.settimeout(timeout)

    # -- frames -------------------------------------------------------------------
    def send(self, message: dict[str, Any]) -> None:
        frame = p.encode(message)
        self._arm()
        self.sock.sendall(frame)

    def recv(self) -> dict[str, Any]:
        header = self._exact(p.HEADER.size)
        return p.decode_body(self._exact(p.parse_header(header)))

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

    # -- bulk bytes ---------------------------------------------------------------
    def _segment_start(self, what: str) -> None:
        """Read a segment's leading byte; after ``SEG_ABORT`` the sender's error frame, raised."""
        marker = self._exact(1)
        if marker == SEG_DATA:
            return
        if marker != SEG_ABORT:
            raise p.ProtocolViolation(f"a bulk segment of {what} began with {marker!r}")
        reply = self.recv()
        message = f"{reply.get('message')}"[:500]
        if reply.get("op") == "error" and reply.get("kind") == "integrity":
            raise IntegrityError(f"the sender stopped {what}: {message}")
        raise p.ProtocolViolation(f"the sender stopped {what}: {message}")

    def abort_bulk(self, message: str, kind: str = "integrity") -> None:
        """Instead of the next segment: ``SEG_ABORT`` and an error frame (the receiver raises it)."""
        self._arm()
        self.sock.sendall(SEG_ABORT + p.encode({"op": "error", "kind": kind, "message": message[:500]}))

    def recv_bytes(self, size: int) -> bytes:
        """``size`` bulk bytes (a small file) into memory, segment by segment."""
        out = bytearray()
        left = size
        while left:
            seg = min(left, p.SEGMENT)
            self._segment_start("a small file")
            out += self._exact(seg)
            left -= seg
        return bytes(out)

    def send_bytes(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        for start in range(0, len(view), p.SEGMENT):
            self._arm()
            self.sock.sendall(SEG_DATA)
            self.sock.sendall(view[start : start + p.SEGMENT])

    def send_fd(self, fd: int, offset: int, length: int, check: StreamCheck | None = None) -> None:
        """``length`` bytes of an open file from ``offset``, segment by segment.

        With ``check``, each segment's items are checked from a read-only mapping before the
        segment goes out; the first that fails is replaced by ``abort_bulk`` (the receiver
        raises IntegrityError, the connection stays in step) and IntegrityError is raised here
        (the caller quarantines the copy). A plain socket sends with ``sendfile``; TLS
        encrypts from the mapping.
        """
        if length == 0:
            return
        segments = [(pos, min(p.SEGMENT, offset + length - pos)) for pos in range(offset, offset + length, p.SEGMENT)]
        if check is None and not self.tls:
            for pos, n in segments:
                self._arm()
                self.sock.sendall(SEG_DATA)
                self._sendfile(fd, pos, n)
            return
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, offset + length - base, flags=flags, prot=mmap.PROT_READ, offset=base)
        view = memoryview(mm)
        try:
            for pos, n in segments:
                with view[pos - base : pos - base + n] as seg:
                    if check is not None:
                        check.update(seg)
                        if check.error is not None:
                            self.abort_bulk(check.error)
                            raise IntegrityError(check.error)
                    self._arm()
                    self.sock.sendall(SEG_DATA)
                    for start in range(0, n, _TLS_WRITE) if self.tls else ():
                        self._arm()
                        self.sock.sendall(seg[start : start + _TLS_WRITE])
                if not self.tls:
                    self._sendfile(fd, pos, n)
            if check is not None:
                try:
                    check.finish()
                except IntegrityError as exc:  # every byte went out already: end the connection
                    raise p.ProtocolViolation(f"sent bytes that fail their checks: {exc}") from None
        finally:
            try:
                view.release()
                mm.close()
            except BufferError:  # a failed send's traceback still holds a slice: the mapping goes with it
                pass

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
        one ``recv_into``, the item checksums, one write per piece.

        A write that fails (ENOSPC, EFBIG) stops the writing but not the reading, so the
        connection stays in step for an error reply; it raises ``WriteFailed`` at the end. A
        sender that aborts (``SEG_ABORT``) raises IntegrityError or ProtocolViolation here.
        """
        buf = bytearray(min(_PIECE, max(size, 1)))
        view = memoryview(buf)
        left, failed = size, None
        while left:
            seg = min(left, p.SEGMENT)
            self._segment_start("sending a file")
            got = 0
            while got < seg:  # each piece checked and written while still in the CPU cache
                want = min(len(buf), seg - got)
                k = 0
                while k < want:  # a TLS read gives one record (16 KiB): fill the piece first, one write
                    self._arm()
                    n = self.sock.recv_into(view[k:want])
                    if n == 0:
                        raise p.ProtocolViolation(f"connection closed with {left - got - k} bytes of a file still to come")
                    k += n
                piece = view[:k]
                if check is not None:
                    check.update(piece)
                if failed is None:
                    failed = _write_all(fd, piece, None if at is None else at + size - left + got)
                got += k
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
