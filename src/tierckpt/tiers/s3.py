"""The durable tier on S3 (AWS, or any S3 server: MinIO, SeaweedFS, Ceph RGW).

Keys are ``<prefix>/<namespace>/step_<N>/<file>``, so every step is a plain DCP checkpoint that
any S3-aware DCP reader can load. S3 has no rename, so data goes straight to its final key and
the ``COMMITTED`` marker alone makes a step visible:

  put_file   deletes the step's marker if it has one (a re-save), then uploads the file
  commit     lists the step once: the manifest's files must all be there with their sizes;
             leftovers of an older save of the step are deleted; the small files are put, the
             manifest last of them; then the marker, with If-None-Match where the server has it
  delete     the marker first, then everything else under the step
  list_steps one recursive listing of the namespace (a page per 1000 keys), never one per rank

boto3 is imported when the first S3 tier is opened; credentials, region and endpoint come from
the standard AWS chain unless ``S3Settings`` overrides them.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tierckpt import layout
from tierckpt.config import CheckpointConfig, S3Settings
from tierckpt.errors import CheckpointNotFoundError, ConfigError, DurableWriteError, StorageError
from tierckpt.observability import get_logger
from tierckpt.tiers.base import Hasher, Source, StepListing
from tierckpt.tiers.s3_retry import Retrier, error_code
from tierckpt.tiers.s3_transfer import download_into, get_scattered, send_views_whole, upload

__all__ = ["S3Reader", "S3Tier", "make_client"]

_log = get_logger("s3")
_AWS_SUFFIXES = (".amazonaws.com", ".amazonaws.com.cn")
_MAP_AT_LEAST = 1 << 20
#: answers of servers that do not understand If-None-Match on PUT
_NO_CONDITIONAL = frozenset({"NotImplemented", "InvalidArgument", "InvalidRequest", "501"})


class S3Tier:
    """A namespace under ``s3://bucket/prefix``; ``client`` is a boto3 S3 client."""

    def __init__(
        self, client: Any, bucket: str, prefix: str, namespace: str, settings: S3Settings, *, name: str = "durable"
    ) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.namespace = namespace
        self.settings = settings
        self.name = name
        self.ns_key = "/".join(p for p in (self.prefix, namespace) if p) + "/"
        self.retrier = Retrier(
            bucket, endpoint=str(client.meta.endpoint_url), max_attempts=settings.max_attempts,
            deadline_s=settings.retry_deadline_s,
        )
        self.conditional_put = True  # until the server refuses If-None-Match
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def from_config(cls, config: CheckpointConfig) -> S3Tier:
        loc = config.durable
        if loc is None or loc.scheme != "s3" or loc.bucket is None:
            raise ConfigError(f"durable_url {config.durable_url!r} is not an 's3://bucket/prefix' URL")
        return cls(make_client(config.s3), loc.bucket, loc.prefix, config.namespace, config.s3)

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.settings.max_concurrency, thread_name_prefix="tierckpt-s3")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- naming -----------------------------------------------------------------------
    def location(self, step: int | None = None) -> str:
        if step is None:
            return f"s3://{self.bucket}/{self.ns_key}".rstrip("/")
        return f"s3://{self.bucket}/{self.step_key(step)}".rstrip("/")

    def step_key(self, step: int) -> str:
        return f"{self.ns_key}{layout.step_dir_name(step)}/"

    def key(self, step: int, name: str) -> str:
        return self.step_key(step) + name

    # -- reads ------------------------------------------------------------------------
    def list_steps(self, *, include_uncommitted: bool = False) -> list[StepListing]:
        steps: dict[int, dict[str, int]] = {}
        for key, size in self._list(self.ns_key):
            dirname, sep, fname = key[len(self.ns_key) :].partition("/")
            step = layout.parse_step_dir(dirname)
            if step is None or not sep or not fname or "/" in fname:
                continue
            steps.setdefault(step, {})[fname] = size
        out = [
            StepListing(step=s, committed=layout.MARKER in files, files=files)
            for s, files in sorted(steps.items())
        ]
        return [s for s in out if s.committed or include_uncommitted]

    def read_file(self, step: int, name: str) -> bytes:
        key = self.key(step, name)

        def get() -> bytes:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
            try:
                return bytes(body.read())
            finally:
                body.close()

        return self.retrier.call(get, what="read", key=key)

    def read_range(self, step: int, name: str, offset: int, length: int) -> memoryview:
        """Parallel ranged GETs (``part_size`` each, ``max_concurrency`` at once) into one buffer."""
        if offset < 0 or length < 0:
            raise ValueError(f"bad range {offset}+{length}")
        # fresh anonymous pages: their first-touch cost is paid by the download threads while
        # they wait on the network, not up front as zero-filling a bytearray would
        buf = mmap.mmap(-1, length) if length >= _MAP_AT_LEAST else bytearray(length)
        download_into(
            self.client, self.retrier, self.pool, self.key(step, name), offset, memoryview(buf),
            part_size=self.settings.part_size,
        )
        return memoryview(buf)

    def open_reader(self, step: int, name: str) -> S3Reader:
        """Ranged GETs of one object straight into the caller's memory (see S3Reader)."""
        return S3Reader(self, self.key(step, name))

    # -- writes -----------------------------------------------------------------------
    def put_file(self, step: int, save_id: str, name: str, source: Source) -> None:
        self._uncommit(step)
        with _source_view(source) as view:
            upload(
                self.client, self.retrier, self.pool, self.key(step, name), view,
                part_size=self.settings.part_size, error=DurableWriteError,
            )

    def commit(self, step: int, save_id: str, files: Mapping[str, bytes]) -> None:
        if layout.MANIFEST not in files:
            raise ValueError("commit needs the manifest among its files")
        base = self.step_key(step)
        present = {key[len(base) :]: size for key, size in self._list(base, DurableWriteError)}
        if layout.MARKER in present:
            self._delete_keys([self.key(step, layout.MARKER)], error=DurableWriteError)
        manifest = layout.Manifest.from_bytes(files[layout.MANIFEST], where=f"{self.location(step)}/{layout.MANIFEST}")
        wrong = sorted(n for n, size in manifest.files.items() if present.get(n) != size)
        if wrong:
            raise DurableWriteError(
                f"cannot commit {self.location(step)}: data file(s) missing or of the wrong size: "
                + ", ".join(f"{n} ({present.get(n, 'absent')} bytes, expected {manifest.files[n]})" for n in wrong),
                tier=self.name, path=self.location(step), step=step,
            )
        stale = [n for n in present if n not in manifest.files and n not in files and n != layout.MARKER]
        if stale:  # files of an older save of this step (another world size): not part of this one
            self._delete_keys([self.key(step, n) for n in stale], error=DurableWriteError)
        for name in sorted(files, key=lambda n: n == layout.MANIFEST):  # the manifest last
            self._put_small(self.key(step, name), files[name])
        self._put_marker(step, layout.marker_bytes(save_id, files[layout.MANIFEST]))

    def delete(self, step: int) -> None:
        self._delete_keys([self.key(step, layout.MARKER)])
        rest = [key for key, _ in self._list(self.step_key(step))]
        self._delete_keys(rest)

    # -- helpers ----------------------------------------------------------------------
    def _list(self, prefix: str, error: type[StorageError] = StorageError) -> Iterator[tuple[str, int]]:
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            page = self.retrier.call(
                partial(self.client.list_objects_v2, **kwargs), what="listing", key=prefix, error=error
            )
            for obj in page.get("Contents", ()):
                yield obj["Key"], int(obj["Size"])
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return

    def _uncommit(self, step: int) -> None:
        """A re-save of a committed step: hide the old copy before overwriting its files."""
        key = self.key(step, layout.MARKER)
        try:
            self.retrier.call(
                lambda: self.client.head_object(Bucket=self.bucket, Key=key), what="check", key=key,
                error=DurableWriteError,
            )
        except CheckpointNotFoundError:
            return
        _log.info("step %d at %s is saved again: removing its commit marker first", step, self.location(step))
        self._delete_keys([key], error=DurableWriteError)

    def _put_small(self, key: str, data: bytes, **extra: Any) -> None:
        self.retrier.call(
            lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=bytes(data), **extra),
            what="upload", key=key, error=DurableWriteError,
        )

    def _put_marker(self, step: int, body: bytes) -> None:
        key = self.key(step, layout.MARKER)
        if self.conditional_put:
            try:
                self._put_small(key, body, IfNoneMatch="*")
                return
            except StorageError as exc:
                code, status = error_code(exc.__cause__ or exc)
                if code == "PreconditionFailed" or status == 412:
                    if self.read_file(step, layout.MARKER) == body:
                        return  # our own earlier try landed; its reply was lost
                    raise DurableWriteError(
                        f"{self.location(step)} was committed by another save while this one ran; "
                        "two jobs are writing the same namespace",
                        tier=self.name, path=self.location(step), step=step,
                    ) from exc
                if code not in _NO_CONDITIONAL and status != 501:
                    raise
                _log.info("%s does not support conditional PUT (%s); writing markers plainly",
                          self.retrier.endpoint, code or status)
                self.conditional_put = False
        self._put_small(key, body)

    def _delete_keys(self, keys: list[str], error: type[StorageError] = StorageError) -> None:
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            reply = self.retrier.call(
                partial(self.client.delete_objects, Bucket=self.bucket, Delete=batch),
                what="delete", key=keys[i], error=error,
            )
            errors = reply.get("Errors") or []
            if errors:
                first = errors[0]
                raise error(
                    f"S3 could not delete {len(errors)} object(s), e.g. s3://{self.bucket}/{first.get('Key')}: "
                    f"{first.get('Code')} {first.get('Message', '')}; check the credentials may delete",
                    tier=self.name, path=f"s3://{self.bucket}/{first.get('Key')}",
                )


class S3Reader:
    """``read_into``: parallel ranged GETs (``part_size`` each) into the caller's buffer, then hashed.

    The hash runs once the range has arrived (parts land out of order); the network, not that
    pass, bounds the time. Nothing is buffered beyond ``out`` itself.
    """

    def __init__(self, tier: S3Tier, key: str) -> None:
        self.tier, self.key = tier, key
        self.concurrency = tier.settings.max_concurrency

    def read_into(self, offset: int, out: memoryview, hasher: Hasher | None = None) -> None:
        t = self.tier
        download_into(t.client, t.retrier, t.pool, self.key, offset, out, part_size=t.settings.part_size)
        if hasher is not None:
            hasher.update(out)

    def read_scattered(self, offset: int, outs: list[memoryview], hasher: Hasher | None = None) -> None:
        """Consecutive bytes into several buffers: one GET up to a part's size, else one read each."""
        t = self.tier
        if sum(len(o) for o in outs) <= t.settings.part_size:
            get_scattered(t.client, t.retrier, self.key, offset, outs)
            if hasher is not None:
                for o in outs:
                    hasher.update(o)
            return
        for o in outs:
            self.read_into(offset, o, hasher)
            offset += len(o)

    def close(self) -> None:
        """Nothing to release: the tier's client and pool outlive one file."""


@contextmanager
def _source_view(source: Source) -> Iterator[memoryview]:
    """A read-only view of the bytes to upload; a file is mapped, not read into memory."""
    if not isinstance(source, Path):
        yield memoryview(source).cast("B")
        return
    with open(source, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            yield memoryview(b"")
            return
        # populate: map every page up front rather than fault them in one by one while sending
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)
    view = memoryview(mm)
    try:
        yield view
    finally:
        view.release()
        try:
            mm.close()
        except BufferError:  # a part's view still lives in a finished request object; GC closes it
            pass


def make_client(settings: S3Settings) -> Any:
    """A boto3 S3 client: the standard AWS chain plus ``settings``; path style for custom endpoints."""
    try:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ProfileNotFound
    except ImportError as exc:
        raise ConfigError("an s3:// durable_url needs boto3: pip install 'tierckpt[s3]'") from exc
    try:
        session = boto3.session.Session(
            profile_name=settings.profile, aws_access_key_id=settings.access_key_id,
            aws_secret_access_key=settings.secret_access_key, aws_session_token=settings.session_token,
            region_name=settings.region,
        )
    except ProfileNotFound as exc:
        raise ConfigError(f"AWS profile {settings.profile!r} is not in ~/.aws/config or ~/.aws/credentials") from exc
    region = session.region_name or "us-east-1"

    def build(style: str) -> Any:
        options: dict[str, Any] = {
            "connect_timeout": settings.connect_timeout_s,
            "read_timeout": settings.read_timeout_s,
            "retries": {"total_max_attempts": 1, "mode": "standard"},  # tierckpt retries, with its own bounds
            "max_pool_connections": settings.max_concurrency + 4,
            # integrity comes from tierckpt's per-item xxh3 checksums, verified on every read, so
            # neither a CRC per request nor a SHA-256 of each body is computed here
            "s3": {"addressing_style": style, "payload_signing_enabled": False},
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
        }
        try:
            config = Config(**options)
        except TypeError:  # botocore older than 1.36 has no checksum options
            del options["request_checksum_calculation"], options["response_checksum_validation"]
            config = Config(**options)
        try:
            return session.client("s3", endpoint_url=settings.endpoint_url, region_name=region, config=config)
        except (BotoCoreError, ValueError) as exc:
            raise ConfigError(f"cannot set up an S3 client ({exc}); check s3.endpoint_url / AWS_ENDPOINT_URL") from exc

    client = build("auto")
    host = urlparse(str(client.meta.endpoint_url)).hostname or ""
    if not host.endswith(_AWS_SUFFIXES):  # MinIO, SeaweedFS, ...: bucket names do not resolve as hosts
        client = build("path")
    client.meta.events.register("before-send.s3", send_views_whole)
    return client
