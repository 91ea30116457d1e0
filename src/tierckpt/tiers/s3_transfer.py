"""Moving bytes to and from S3: multipart uploads streamed from a buffer, parallel ranged reads.

``upload`` sends a memoryview (a mapped shared-memory slot) as one object: a single PUT when it
fits in one part, else a multipart upload whose parts go out in parallel, each read straight
from the mapping (no copy of a part is made). Any failure aborts the multipart upload, so
nothing half-written stays behind. ``download_into`` fills a caller's buffer with parallel
ranged GETs, each read straight into its slice of the buffer.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from tierckpt.errors import StorageError
from tierckpt.observability import get_logger
from tierckpt.tiers.s3_retry import Retrier, ShortReadError, error_code

__all__ = ["download_into", "get_scattered", "send_views_whole", "upload"]

_READ_CHUNK = 1 << 20  # bytes per readinto(): big enough to amortise, small enough to stay in cache
_log = get_logger("s3")


class _ViewReader(io.RawIOBase):
    """A seekable file over a memoryview: botocore streams it and rewinds it for a retry."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), len(self._view) - self._pos)
        if n <= 0:
            return 0
        memoryview(buffer).cast("B")[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        out = bytes(self._view[self._pos : end]) if end > self._pos else b""
        self._pos += len(out)
        return out

    def __len__(self) -> int:
        return len(self._view)

    def remaining(self) -> memoryview:
        return self._view[self._pos :]


def send_views_whole(request: Any, **_: Any) -> None:
    """botocore ``before-send`` hook: hand urllib3 the view itself, not the file over it.

    A file body is sent 16 KiB per read() call, each read copying; a memoryview goes to the
    socket in one ``sendall`` with no copy. Validation has already accepted the file, and no
    retry inside botocore rewinds the body (tierckpt retries, with a fresh file per try).
    """
    body = getattr(request, "body", None)
    if isinstance(body, _ViewReader):
        request.body = body.remaining()


def upload(
    client: Any,
    retrier: Retrier,
    pool: ThreadPoolExecutor,
    key: str,
    view: memoryview,
    *,
    part_size: int,
    error: type[StorageError],
) -> None:
    """Store ``view`` as object ``key``; parts of ``part_size`` bytes go out on ``pool``."""
    bucket = retrier.bucket
    if len(view) <= part_size:
        retrier.call(
            lambda: client.put_object(Bucket=bucket, Key=key, Body=_ViewReader(view)),
            what="upload", key=key, error=error,
        )
        return
    upload_id = retrier.call(
        lambda: client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"],
        what="multipart upload start", key=key, error=error,
    )
    stop = threading.Event()

    def send(number: int, lo: int, hi: int) -> dict[str, Any]:
        if stop.is_set():  # a sibling failed: do not start more parts
            raise StorageError("cancelled")
        etag = retrier.call(
            lambda: client.upload_part(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=_ViewReader(view[lo:hi])
            )["ETag"],
            what=f"upload of part {number}", key=key, error=error, stop=stop,
        )
        return {"PartNumber": number, "ETag": etag}

    bounds = [(lo, min(len(view), lo + part_size)) for lo in range(0, len(view), part_size)]
    futures = [pool.submit(send, i + 1, lo, hi) for i, (lo, hi) in enumerate(bounds)]
    try:
        parts = _gather(futures, stop)
        _complete(client, retrier, key, upload_id, parts, len(view), error)
    except BaseException:
        _abort(client, retrier, key, upload_id)
        raise


def _gather(futures: list[Future[Any]], stop: threading.Event) -> list[Any]:
    """Results in order; on the first failure stop the rest, wait for them, re-raise it."""
    try:
        return [f.result() for f in futures]
    except BaseException:
        stop.set()
        for f in futures:
            f.cancel()
        wait(futures)
        raise


def _complete(
    client: Any, retrier: Retrier, key: str, upload_id: str, parts: list[Any], size: int,
    error: type[StorageError],
) -> None:
    bucket = retrier.bucket
    try:
        retrier.call(
            lambda: client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            ),
            what="multipart upload completion", key=key, error=error,
        )
    except StorageError as exc:
        # a retry after a lost reply finds the upload gone: it completed if the object is whole
        if error_code(exc.__cause__ or exc)[0] != "NoSuchUpload":
            raise
        head = retrier.call(lambda: client.head_object(Bucket=bucket, Key=key), what="check", key=key, error=error)
        if head.get("ContentLength") != size:
            raise


def _abort(client: Any, retrier: Retrier, key: str, upload_id: str) -> None:
    try:
        retrier.call(
            lambda: client.abort_multipart_upload(Bucket=retrier.bucket, Key=key, UploadId=upload_id),
            what="multipart upload abort", key=key,
        )
    except Exception as exc:  # the upload already failed; report that one, log this one
        _log.warning("could not abort multipart upload %s of %s: %s", upload_id, retrier.url(key), exc)


def download_into(
    client: Any,
    retrier: Retrier,
    pool: ThreadPoolExecutor,
    key: str,
    offset: int,
    out: memoryview,
    *,
    part_size: int,
) -> None:
    """Fill ``out`` with the object's bytes from ``offset``, ``part_size`` bytes per ranged GET."""
    if len(out) == 0:
        return
    bounds = [(lo, min(len(out), lo + part_size)) for lo in range(0, len(out), part_size)]
    if len(bounds) == 1:
        _get_range(client, retrier, key, offset, out)
        return
    stop = threading.Event()

    def fetch(lo: int, hi: int) -> None:
        if stop.is_set():
            raise StorageError("cancelled")
        _get_range(client, retrier, key, offset + lo, out[lo:hi], stop)

    _gather([pool.submit(fetch, lo, hi) for lo, hi in bounds], stop)


def get_scattered(client: Any, retrier: Retrier, key: str, start: int, outs: list[memoryview]) -> None:
    """One ranged GET of ``sum(len(o) for o in outs)`` bytes from ``start``, filling ``outs`` in turn."""
    _get_range(client, retrier, key, start, outs)


def _get_range(
    client: Any, retrier: Retrier, key: str, start: int, out: memoryview | list[memoryview],
    stop: threading.Event | None = None,
) -> None:
    outs = out if isinstance(out, list) else [out]
    total = sum(len(o) for o in outs)
    if total == 0:
        return

    def attempt() -> None:
        resp = client.get_object(Bucket=retrier.bucket, Key=key, Range=f"bytes={start}-{start + total - 1}")
        body = resp["Body"]
        try:
            if resp.get("ContentLength") != total:
                raise StorageError(
                    f"{retrier.url(key)} holds fewer bytes than asked for "
                    f"({start}..{start + total}); the object is shorter than its manifest says",
                    tier="durable", path=retrier.url(key),
                )
            for o in outs:
                _read_exactly(body.readinto, o)
        finally:
            body.close()

    retrier.call(attempt, what="read", key=key, stop=stop)


def _read_exactly(readinto: Callable[[memoryview], int], out: memoryview) -> None:
    pos = 0
    while pos < len(out):
        n = readinto(out[pos : pos + _READ_CHUNK])
        if not n:
            raise ShortReadError(f"body ended after {pos} of {len(out)} bytes")
        pos += n
