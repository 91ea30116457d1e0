"""S3Tier on a real S3 server: the Tier conformance suite, the key layout, the commit protocol,
the request pattern (one listing, marker last / first) and the errors a user can meet."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.contract.tier_contract import TierContract, commit
from tests.s3.faultproxy import Fault, s3_error
from tierckpt import layout
from tierckpt.config import CheckpointConfig, S3Settings
from tierckpt.errors import CheckpointNotFoundError, ConfigError, DurableWriteError, StorageError
from tierckpt.tiers import open_durable
from tierckpt.tiers.s3 import S3Tier, make_client

pytestmark = pytest.mark.s3

MIB = 1 << 20
SETTINGS = S3Settings(part_size=5 * MIB, max_concurrency=4, max_attempts=3, retry_deadline_s=10)


def calls_of(client: Any) -> list[tuple[str, Any]]:
    """Every S3 call the client makes from now on: (operation, key / prefix / deleted keys)."""
    calls: list[tuple[str, Any]] = []

    def hook(model: Any, params: dict[str, Any], **_: Any) -> None:
        if model.name == "DeleteObjects":
            what: Any = [o["Key"] for o in params["Delete"]["Objects"]]
        else:
            what = params.get("Key", params.get("Prefix", ""))
        calls.append((model.name, what))

    client.meta.events.register("before-parameter-build.s3", hook)
    return calls


def manifest(step: int, files: dict[str, int], ns: str = "ns", save_id: str = "s1") -> bytes:
    return layout.Manifest(
        namespace=ns, step=step, save_id=save_id, world_size=len(files),
        metadata_xxh3=layout.checksum(b"md"), files=files,
    ).to_bytes()


@pytest.fixture
def tier(s3_client: Any, bucket: str) -> Any:
    t = S3Tier(s3_client, bucket, "pre/fix", "contract", SETTINGS)
    yield t
    t.close()


class TestS3Tier(TierContract):
    """The suite every tier passes, run against SeaweedFS."""


def keys(client: Any, bucket: str, prefix: str = "") -> list[str]:
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def test_multipart_upload_from_a_mapped_file_and_parallel_ranged_reads(tier: S3Tier, tmp_path: Path) -> None:
    payload = os.urandom(12 * MIB + 12345)  # three parts, the last one short
    src = tmp_path / "slot"
    src.write_bytes(payload)
    calls = calls_of(tier.client)
    tier.put_file(1, "s1", "__0_0.distcp", src)
    ops = [op for op, _ in calls]
    assert ops.count("CreateMultipartUpload") == 1 and ops.count("UploadPart") == 3
    assert ops.count("CompleteMultipartUpload") == 1
    calls.clear()
    assert bytes(tier.read_range(1, "__0_0.distcp", 0, len(payload))) == payload
    assert [op for op, _ in calls] == ["GetObject"] * 3  # one ranged GET per part
    lo = 5 * MIB - 7  # a span across a part boundary
    assert bytes(tier.read_range(1, "__0_0.distcp", lo, MIB)) == payload[lo : lo + MIB]
    assert src.read_bytes() == payload  # the source is only read


def test_step_is_plain_keys_under_prefix_and_namespace(tier: S3Tier, bucket: str) -> None:
    commit(tier, 7)
    assert keys(tier.client, bucket) == [
        f"pre/fix/contract/step_7/{name}"
        for name in sorted([".metadata", "COMMITTED", "__0_0.distcp", "manifest.json"])
    ]
    assert tier.location(7) == f"s3://{bucket}/pre/fix/contract/step_7"


def test_commit_writes_manifest_then_marker_last_conditionally(tier: S3Tier) -> None:
    tier.put_file(2, "s1", "__0_0.distcp", b"x" * 10)
    seen: list[dict[str, Any]] = []
    tier.client.meta.events.register(
        "before-parameter-build.s3.PutObject", lambda params, **_: seen.append(dict(params))
    )
    tier.commit(2, "s1", {layout.MANIFEST: manifest(2, {"__0_0.distcp": 10}, "contract"), layout.METADATA: b"md"})
    assert [p["Key"].rsplit("/", 1)[1] for p in seen] == [".metadata", "manifest.json", "COMMITTED"]
    assert seen[-1].get("IfNoneMatch") == "*" and "IfNoneMatch" not in seen[0]
    assert tier.conditional_put  # SeaweedFS honours If-None-Match


def test_commit_refuses_a_step_whose_data_is_missing(tier: S3Tier) -> None:
    tier.put_file(3, "s1", "__0_0.distcp", b"x" * 10)
    files = {"__0_0.distcp": 10, "__1_0.distcp": 10}  # rank 1 never uploaded
    with pytest.raises(DurableWriteError, match=r"__1_0\.distcp \(absent"):
        tier.commit(3, "s1", {layout.MANIFEST: manifest(3, files, "contract"), layout.METADATA: b"md"})
    assert tier.list_steps() == []


def test_resave_hides_the_old_copy_before_uploading(tier: S3Tier) -> None:
    commit(tier, 5, b"old" * 100, save_id="a")
    calls = calls_of(tier.client)
    tier.put_file(5, "b", "__0_0.distcp", b"new" * 100)
    marker = tier.key(5, layout.MARKER)
    assert calls[:3] == [("HeadObject", marker), ("DeleteObjects", [marker]), ("PutObject", tier.key(5, "__0_0.distcp"))]
    assert tier.list_steps() == []  # between the upload and the commit, step 5 does not exist


def test_resave_with_fewer_ranks_drops_the_old_ranks_files(tier: S3Tier, bucket: str) -> None:
    for r in (0, 1):
        tier.put_file(4, "a", f"__{r}_0.distcp", b"r" * 10)
    both = {"__0_0.distcp": 10, "__1_0.distcp": 10}
    tier.commit(4, "a", {layout.MANIFEST: manifest(4, both, "contract"), layout.METADATA: b"md"})
    tier.put_file(4, "b", "__0_0.distcp", b"s" * 20)
    tier.commit(4, "b", {layout.MANIFEST: manifest(4, {"__0_0.distcp": 20}, "contract"), layout.METADATA: b"md"})
    assert [k.rsplit("/", 1)[1] for k in keys(tier.client, bucket)] == [".metadata", "COMMITTED", "__0_0.distcp", "manifest.json"]


def test_delete_removes_the_marker_before_anything_else(tier: S3Tier) -> None:
    commit(tier, 1)
    calls = calls_of(tier.client)
    tier.delete(1)
    assert calls[0] == ("DeleteObjects", [tier.key(1, layout.MARKER)])
    assert calls[1][0] == "ListObjectsV2"
    assert sorted(calls[2][1]) == sorted(tier.key(1, n) for n in (".metadata", "__0_0.distcp", "manifest.json"))


def test_finding_steps_costs_one_listing(tier: S3Tier) -> None:
    for step in (1, 2, 3, 10, 20):
        commit(tier, step, b"d" * 10)
    tier.put_file(30, "s9", "__0_0.distcp", b"u")  # a save in progress
    calls = calls_of(tier.client)
    assert [s.step for s in tier.list_steps()] == [1, 2, 3, 10, 20]
    assert calls == [("ListObjectsV2", tier.ns_key)]
    everything = tier.list_steps(include_uncommitted=True)
    assert [(s.step, s.committed) for s in everything][-1] == (30, False)


def test_listing_pages_past_a_thousand_keys(s3_client: Any, bucket: str) -> None:
    tier = S3Tier(s3_client, bucket, "", "many", SETTINGS)
    keys_ = [tier.key(1, f"__{r}_0.distcp") for r in range(1100)]
    with ThreadPoolExecutor(8) as pool:  # 1100 tiny objects, put in parallel
        list(pool.map(lambda k: s3_client.put_object(Bucket=bucket, Key=k, Body=b"x"), keys_))
    [listing] = tier.list_steps(include_uncommitted=True)
    assert len(listing.files) == 1100 and not listing.committed


def test_marker_put_is_idempotent_and_detects_another_commit(tier: S3Tier) -> None:
    tier._put_marker(6, b"mine")
    tier._put_marker(6, b"mine")  # a retry whose first reply was lost
    with pytest.raises(DurableWriteError, match="committed by another save"):
        tier._put_marker(6, b"someone else")


def test_server_without_conditional_put_falls_back(s3_env: dict[str, str], bucket: str, proxy: Any) -> None:
    proxy.add(Fault("reply", method="PUT", header="If-None-Match", times=None, status=501,
                    body=s3_error("NotImplemented", "A header you provided implies functionality that is not implemented")))
    tier = S3Tier(make_client(S3Settings(endpoint_url=proxy.url)), bucket, "", "ns", SETTINGS)
    commit(tier, 1)
    assert not tier.conditional_put
    assert [s.step for s in tier.list_steps()] == [1]
    commit(tier, 2)  # later commits go straight to a plain PUT
    assert sum(1 for m, _, status in proxy.log if status == "501") == 1


# -- errors --------------------------------------------------------------------------------
def requests_sent(client: Any) -> list[tuple[str, str]]:
    """Every HTTP request ``client`` sends from now on, as (method, object key or "list")."""
    sent: list[tuple[str, str]] = []

    def record(request: Any, **_: Any) -> None:
        path = request.url.split("?")[0].split("/", 4)
        sent.append((request.method, path[4] if len(path) > 4 and path[4] else "list"))

    client.meta.events.register("before-send.s3", record)
    return sent


def test_wrong_access_key_fails_fast_and_names_the_credentials(s3_env: dict[str, str], bucket: str) -> None:
    tier = S3Tier(make_client(S3Settings(access_key_id="nobody", secret_access_key="x")), bucket, "", "ns", SETTINGS)
    sent = requests_sent(tier.client)
    with pytest.raises(StorageError, match="check the credentials") as info:
        tier.list_steps()
    assert sent == [("GET", "list")]  # one request: a refusal is not retried
    assert "InvalidAccessKeyId" in str(info.value)


def test_wrong_secret_key_on_upload_is_a_durable_write_error(s3_env: dict[str, str], bucket: str) -> None:
    settings = S3Settings(access_key_id=s3_env["AWS_ACCESS_KEY_ID"], secret_access_key="wrong")
    tier = S3Tier(make_client(settings), bucket, "", "ns", SETTINGS)
    with pytest.raises(DurableWriteError, match="refused.*check the credentials"):
        tier.put_file(1, "s", "__0_0.distcp", b"abc")


def test_missing_credentials_say_how_to_set_them(s3_env: dict[str, str], bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    tier = S3Tier(make_client(S3Settings()), bucket, "", "ns", SETTINGS)
    with pytest.raises(StorageError, match="no AWS credentials found.*AWS_ACCESS_KEY_ID"):
        tier.list_steps()


def test_missing_bucket_says_create_it(s3_client: Any) -> None:
    tier = S3Tier(s3_client, "no-such-bucket-here", "p", "ns", SETTINGS)
    sent = requests_sent(s3_client)
    with pytest.raises(StorageError, match="'no-such-bucket-here' does not exist.*create the bucket"):
        tier.list_steps()
    assert sent == [("GET", "list")]
    with pytest.raises(DurableWriteError, match="does not exist"):
        tier.put_file(1, "s", "__0_0.distcp", b"abc")
    assert len(sent) == len(set(sent)), sent  # no request was sent twice: nothing retried


def test_missing_object_is_not_found(tier: S3Tier) -> None:
    with pytest.raises(CheckpointNotFoundError):
        tier.read_range(9, "__0_0.distcp", 0, 10)


@pytest.mark.parametrize(
    "url, hint",
    [
        ("s3://", "no valid bucket name"),
        ("s3://My_Bucket/ckpt", "no valid bucket name"),
        ("s3://bucket/a//ckpt", "malformed"),
        ("s3://bucket/ckpt?x=1", "malformed"),
        ("s4://bucket/ckpt", "not supported"),
    ],
)
def test_malformed_url_is_a_config_error(url: str, hint: str) -> None:
    with pytest.raises(ConfigError, match=hint):
        CheckpointConfig(namespace="ns", durable_url=url)


def test_open_durable_builds_an_s3_tier_from_the_aws_variables(s3_env: dict[str, str], bucket: str) -> None:
    config = CheckpointConfig(namespace="ns", durable_url=f"s3://{bucket}/a/b/", s3=SETTINGS)
    tier = open_durable(config)
    assert isinstance(tier, S3Tier)
    assert tier.ns_key == "a/b/ns/" and tier.client.meta.endpoint_url == s3_env["AWS_ENDPOINT_URL"]
    assert tier.client.meta.config.s3["addressing_style"] == "path"  # custom endpoints
    tier.close()


def test_aws_endpoints_keep_virtual_hosted_style(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    client = make_client(S3Settings(region="eu-west-1", access_key_id="a", secret_access_key="b"))
    assert "amazonaws.com" in client.meta.endpoint_url
    assert client.meta.config.s3["addressing_style"] == "auto"


def test_unknown_profile_is_a_config_error(s3_env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="profile 'nope'"):
        make_client(S3Settings(profile="nope"))


def test_without_boto3_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)
    with pytest.raises(ConfigError, match=r"pip install 'tierckpt\[s3\]'"):
        make_client(S3Settings())
