"""S3 client libraries side by side: one object, same bytes, same server, same part size.

Each ``Client`` uploads a file that sits in shared memory (as a memory-tier slot does) and
downloads it into one preallocated buffer, the way a tier must. The figures chose tierckpt's
client (docs/s3.md): boto3 with tierckpt's own parallel parts, boto3's s3transfer,
s3torchconnector's CRT-based client and obstore (Rust object_store).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CLIENTS", "Client", "make_clients"]


@dataclass
class Client:
    """``upload(key, path)`` and ``download(key, out)`` of one library; ``close()`` at the end."""

    name: str
    upload: Callable[[str, Path], None]
    download: Callable[[str, memoryview], None]
    close: Callable[[], None] = lambda: None


def _mapped(path: Path) -> tuple[mmap.mmap, memoryview]:
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), os.fstat(f.fileno()).st_size, access=mmap.ACCESS_READ)
    return mm, memoryview(mm)


def tierckpt_boto3(endpoint: str, bucket: str, part: int, conc: int) -> Client:
    """What S3Tier does: boto3, parts sent in parallel straight from the mapping; ranged GETs."""
    from tierckpt.config import S3Settings
    from tierckpt.tiers.s3 import make_client
    from tierckpt.tiers.s3_retry import Retrier
    from tierckpt.tiers.s3_transfer import download_into, upload

    settings = S3Settings(endpoint_url=endpoint, part_size=part, max_concurrency=conc)
    client = make_client(settings)
    retrier = Retrier(bucket, endpoint, max_attempts=3, deadline_s=60)
    pool = ThreadPoolExecutor(conc)

    def up(key: str, path: Path) -> None:
        mm, view = _mapped(path)
        try:
            from tierckpt.errors import StorageError

            upload(client, retrier, pool, key, view, part_size=part, error=StorageError)
        finally:
            view.release()
            mm.close()

    def down(key: str, out: memoryview) -> None:
        download_into(client, retrier, pool, key, 0, out, part_size=part)

    return Client("boto3 + tierckpt parts (chosen)", up, down, lambda: pool.shutdown())


def s3transfer(endpoint: str, bucket: str, part: int, conc: int) -> Client:
    """boto3's managed transfers (upload_fileobj / download_fileobj), default client settings."""
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=endpoint, config=Config(
        s3={"addressing_style": "path"}, max_pool_connections=conc + 4))
    tc = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc)

    def up(key: str, path: Path) -> None:
        client.upload_file(str(path), bucket, key, Config=tc)

    def down(key: str, out: memoryview) -> None:
        class Sink:  # download_fileobj writes parts in order through a seekable file
            pos = 0

            def write(self, data: bytes) -> int:
                out[self.pos : self.pos + len(data)] = data
                self.pos += len(data)
                return len(data)

            def seek(self, pos: int, whence: int = 0) -> int:
                self.pos = pos
                return pos

        client.download_fileobj(bucket, key, Sink(), Config=tc)

    return Client("boto3 s3transfer", up, down)


def s3torchconnector(endpoint: str, bucket: str, part: int, conc: int) -> Client:
    """s3torchconnector's client (AWS CRT / mountpoint-s3-client): streamed put, streamed get."""
    from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client

    client = MountpointS3Client(region="us-east-1", endpoint=endpoint, part_size=part, force_path_style=True)

    def up(key: str, path: Path) -> None:
        mm, view = _mapped(path)
        try:
            stream = client.put_object(bucket, key)
            for lo in range(0, len(view), part):
                stream.write(bytes(view[lo : lo + part]))  # its write() takes bytes only
            stream.close()
        finally:
            view.release()
            mm.close()

    def down(key: str, out: memoryview) -> None:
        pos = 0
        for chunk in client.get_object(bucket, key):
            out[pos : pos + len(chunk)] = chunk
            pos += len(chunk)

    return Client("s3torchconnector client", up, down)


def obstore(endpoint: str, bucket: str, part: int, conc: int) -> Client:
    """obstore (Rust object_store): multipart put from the file, get_ranges in parallel."""
    import obstore as obs
    from obstore.store import S3Store

    store = S3Store(
        bucket, endpoint=endpoint, region="us-east-1", virtual_hosted_style_request=False,
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"], secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        client_options={"allow_http": True},
    )

    def up(key: str, path: Path) -> None:
        obs.put(store, key, path, chunk_size=part, max_concurrency=conc)

    def down(key: str, out: memoryview) -> None:
        starts = list(range(0, len(out), part))
        lengths = [min(part, len(out) - s) for s in starts]
        for start, data in zip(starts, obs.get_ranges(store, key, starts=starts, lengths=lengths, coalesce=0), strict=True):
            out[start : start + len(data)] = memoryview(data)

    return Client("obstore", up, down)


CLIENTS: dict[str, Callable[[str, str, int, int], Client]] = {
    "tierckpt_boto3": tierckpt_boto3,
    "s3transfer": s3transfer,
    "s3torchconnector_client": s3torchconnector,
    "obstore": obstore,
}


def make_clients(names: list[str], endpoint: str, bucket: str, part: int, conc: int) -> list[Client]:
    """The named clients that can be imported here; a missing library is skipped with a note."""
    out = []
    for name in names:
        try:
            out.append(CLIENTS[name](endpoint, bucket, part, conc))
        except ImportError as exc:
            print(f"  (skipping {name}: {exc})")
    return out
