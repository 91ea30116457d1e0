"""Faults between tierckpt and S3, injected by a proxy: throttling, server errors, connections
reset mid-body, replies slower than the read timeout. Transient faults are retried away; once
attempts or the deadline run out the caller gets a typed error and no step looks committed."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.contract.tier_contract import commit
from tests.s3.faultproxy import Fault
from tierckpt import Checkpointer, layout
from tierckpt.config import CheckpointConfig, S3Settings
from tierckpt.errors import DurableWriteError, StorageError
from tierckpt.tiers.s3 import S3Tier, make_client
from tierckpt.tiers.s3_retry import Retrier

pytestmark = pytest.mark.s3

MIB = 1 << 20
PART = r"partNumber=\d+"


def s3_tier(proxy: Any, bucket: str, **overrides: Any) -> S3Tier:
    settings = S3Settings(**{
        "endpoint_url": proxy.url, "part_size": 5 * MIB, "max_concurrency": 4,
        "max_attempts": 5, "retry_deadline_s": 20.0, **overrides,
    })
    return S3Tier(make_client(settings), bucket, "faults", "ns", settings)


def outcomes(proxy: Any, pattern: str = "") -> list[str]:
    return [status for _, path, status in proxy.log if pattern in path]


@pytest.fixture
def payload(tmp_path: Path) -> tuple[Path, bytes]:
    data = random.Random(7).randbytes(11 * MIB + 333)
    path = tmp_path / "slot"
    path.write_bytes(data)
    return path, data


def test_upload_survives_throttling_errors_and_resets(s3_env: Any, bucket: str, proxy: Any, payload: Any) -> None:
    src, data = payload
    tier = s3_tier(proxy, bucket)
    proxy.add(Fault("slowdown", method="PUT", path="partNumber=1", times=2))
    proxy.add(Fault("internal", method="PUT", path="partNumber=2", times=1))
    proxy.add(Fault("reset_request", method="PUT", path="partNumber=3", times=1))
    proxy.add(Fault("slowdown", method="POST", path="uploadId=", times=1))  # the completion
    tier.put_file(1, "s1", "__0_0.distcp", src)
    log = outcomes(proxy)
    assert log.count("503") == 3 and log.count("500") == 1 and log.count("reset_request") == 1
    assert bytes(tier.read_range(1, "__0_0.distcp", 0, len(data))) == data
    tier.close()


def test_download_survives_resets_mid_body_and_throttling(s3_env: Any, bucket: str, proxy: Any, payload: Any) -> None:
    src, data = payload
    tier = s3_tier(proxy, bucket)
    tier.put_file(1, "s1", "__0_0.distcp", src)
    proxy.clear()
    proxy.add(Fault("reset", method="GET", path="__0_0.distcp", times=2))
    proxy.add(Fault("slowdown", method="GET", path="__0_0.distcp", times=2))
    got = tier.read_range(1, "__0_0.distcp", 0, len(data))
    assert bytes(got) == data
    log = outcomes(proxy, "__0_0.distcp")
    assert log.count("reset") == 2 and log.count("503") == 2 and log.count("206") == 3
    tier.close()


def test_reply_slower_than_the_read_timeout_is_retried(s3_env: Any, bucket: str, proxy: Any) -> None:
    tier = s3_tier(proxy, bucket, read_timeout_s=0.5)
    commit(tier, 2, b"abc" * 1000)
    proxy.clear()
    proxy.add(Fault("delay", method="GET", path="manifest.json", seconds=1.5))
    assert layout.Manifest.from_bytes(tier.read_file(2, layout.MANIFEST)).step == 2
    assert outcomes(proxy, "manifest.json") == ["delay", "200"]  # the slow one, then the retry
    tier.close()


def test_exhausted_upload_retries_give_a_typed_error_and_leave_nothing_behind(
    s3_env: Any, bucket: str, proxy: Any, payload: Any, s3_client: Any
) -> None:
    src, _ = payload
    tier = s3_tier(proxy, bucket, max_attempts=3)
    proxy.add(Fault("slowdown", method="PUT", path="partNumber=2", times=None))
    with pytest.raises(DurableWriteError, match=r"part 2 .*failed after 3 attempt\(s\).*SlowDown") as info:
        tier.put_file(1, "s1", "__0_0.distcp", src)
    assert info.value.tier == "durable"
    assert outcomes(proxy, "partNumber=2") == ["503"] * 3  # exactly max_attempts: botocore adds none
    assert any(method == "DELETE" and "uploadId=" in path for method, path, _ in proxy.log)  # aborted
    assert s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert tier.list_steps(include_uncommitted=True) == []
    tier.close()


def test_retry_deadline_bounds_the_total_time(s3_env: Any, bucket: str, proxy: Any) -> None:
    tier = s3_tier(proxy, bucket, max_attempts=1000, retry_deadline_s=1.0)
    proxy.add(Fault("slowdown", method="GET", times=None))
    with pytest.raises(StorageError, match=r"failed after (\d+) attempt.*retry_deadline_s") as info:
        tier.list_steps()
    tries = outcomes(proxy)
    # the deadline, not the 1000 attempts, ended it: several retries, every one of them counted
    assert 2 <= len(tries) < 20 and set(tries) == {"503"}, tries
    assert f"failed after {len(tries)} attempt(s)" in str(info.value)
    tier.close()


def test_a_commit_that_cannot_write_its_marker_leaves_no_committed_step(
    s3_env: Any, bucket: str, proxy: Any
) -> None:
    tier = s3_tier(proxy, bucket, max_attempts=3)
    commit(tier, 1, b"one")
    proxy.add(Fault("slowdown", method="PUT", path="/COMMITTED", times=None))
    with pytest.raises(DurableWriteError, match="COMMITTED"):
        commit(tier, 2, b"two")
    assert [s.step for s in tier.list_steps()] == [1]  # the data of step 2 is there, unseen
    assert {s.step: s.committed for s in tier.list_steps(include_uncommitted=True)} == {1: True, 2: False}
    tier.close()


def test_checkpointer_drains_through_faults_and_keeps_memory_when_s3_gives_up(
    s3_env: Any, bucket: str, proxy: Any, memory_dir: str
) -> None:
    settings = S3Settings(endpoint_url=proxy.url, part_size=5 * MIB, max_concurrency=4, max_attempts=3, retry_deadline_s=10)
    config = CheckpointConfig(namespace="drain", memory_dir=memory_dir, durable_url=f"s3://{bucket}/ck", s3=settings)
    state = {"w": torch.arange(3 * MIB, dtype=torch.float32), "b": torch.randn(17)}  # 12 MiB: multipart
    proxy.add(Fault("slowdown", method="PUT", path=PART, times=3))
    proxy.add(Fault("reset_request", method="PUT", path="/COMMITTED", times=1))
    ck = Checkpointer(config)
    try:
        ck.save(1, state, durable=True).result(60)
        proxy.add(Fault("slowdown", method="PUT", path=PART, times=None))
        handle = ck.save(2, {k: v + 1 for k, v in state.items()}, durable=True)
        with pytest.raises(DurableWriteError, match="memory copy is intact.*after 3 attempt"):
            handle.result(60)
        durable = ck.runtime.durable
        assert durable is not None and [s.step for s in durable.list_steps()] == [1]
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ck.load(target) == 2  # the memory copy of step 2 is whole
        assert all(torch.equal(target[k], state[k] + 1) for k in state)
    finally:
        ck.close(raise_errors=False)
    log = outcomes(proxy)
    assert "reset_request" in log and log.count("503") >= 3


def test_backoff_grows_with_jitter_and_a_ceiling() -> None:
    r = Retrier("b", "http://x", max_attempts=10, deadline_s=60, base_delay_s=0.1, max_delay_s=2.0)
    for attempt, full in [(1, 0.1), (2, 0.2), (3, 0.4), (6, 2.0), (9, 2.0)]:
        waits = [r.delay(attempt) for _ in range(200)]
        assert full / 2 <= min(waits) and max(waits) <= full
        assert len(set(waits)) > 100  # jittered, so ranks do not retry in lockstep


def test_only_transient_failures_are_retried() -> None:
    from botocore.exceptions import ClientError, EndpointConnectionError

    slept: list[float] = []
    r = Retrier("b", "http://x", max_attempts=4, deadline_s=60, sleep=slept.append)
    tries = iter([EndpointConnectionError(endpoint_url="http://x"), ConnectionResetError(), "ok"])

    def flaky() -> str:
        item = next(tries)
        if isinstance(item, BaseException):
            raise item
        return item

    assert r.call(flaky, what="read", key="k") == "ok" and len(slept) == 2
    denied = ClientError({"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "GetObject")
    calls = []

    def refuse() -> None:
        calls.append(1)
        raise denied

    with pytest.raises(StorageError, match="check the credentials"):
        r.call(refuse, what="read", key="k")
    assert calls == [1]


@pytest.fixture(autouse=True)
def _no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
