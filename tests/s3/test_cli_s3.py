"""The CLI against the real SeaweedFS server: promote to S3, gc of marker-less steps and aborted uploads."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cli.conftest import Result, model_state
from tierckpt import CheckpointConfig, Checkpointer
from tierckpt.tiers.s3 import S3Tier

NS = "run1"


@pytest.fixture
def config(s3_env: dict[str, str], bucket: str, memory_dir: str) -> CheckpointConfig:
    return CheckpointConfig(namespace=NS, memory_dir=memory_dir, durable_url=f"s3://{bucket}/ckpt",
                            durable_every_n_steps=0)


@pytest.fixture
def argv(config: CheckpointConfig) -> list[str]:
    return ["--namespace", NS, "--memory-dir", config.memory_dir, "--durable-url", config.durable_url or ""]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Any:
    from tierckpt import cli as cli_module

    def run(*args: str) -> Result:
        capsys.readouterr()
        rc = cli_module.main(list(args))
        captured = capsys.readouterr()
        return Result(rc, captured.out, captured.err)

    return run


@pytest.fixture
def empty_memory() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="tierckpt-s3test-empty-", dir="/dev/shm") as path:
        yield path


def _keys(s3_client: Any, bucket: str, prefix: str) -> list[str]:
    return sorted(o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", ()))


def test_promote_to_s3_commits_verifies_and_loads_alone(  # type: ignore[no-untyped-def]
    config, argv, cli, s3_client, bucket, empty_memory
) -> None:
    with Checkpointer(config) as ck:
        ck.save(6, model_state(6)).result(60)  # memory only
    assert _keys(s3_client, bucket, "ckpt/") == []
    r = cli(*argv, "promote", "6")
    assert r.rc == 0, r.err
    assert f"verified at s3://{bucket}/ckpt/{NS}/step_6" in r.out and "promote step 6: 100%" in r.err
    keys = _keys(s3_client, bucket, f"ckpt/{NS}/step_6/")
    assert f"ckpt/{NS}/step_6/COMMITTED" in keys and f"ckpt/{NS}/step_6/manifest.json" in keys
    assert cli(*argv, "verify", "6").rc == 0
    with Checkpointer(config.replace(memory_dir=empty_memory)) as ck:
        target = model_state(0)
        assert ck.load(target) == 6
    want = model_state(6)
    for group in ("model", "optim"):
        for key, tensor in want[group].items():
            assert torch.equal(target[group][key].view(torch.uint8), tensor.view(torch.uint8)), key
    assert target["lr"] == want["lr"]


@pytest.mark.slow  # 20-33 s on the loaded 2-core box: a fresh interpreter with torch, or a seed round-trip
def test_gc_on_s3_takes_marker_less_steps_and_aborted_uploads_never_a_committed_step(  # type: ignore[no-untyped-def]
    config, argv, cli, s3_client, bucket
) -> None:
    with Checkpointer(config) as ck:
        ck.save(1, model_state(1), durable=True).result(60)
    committed = _keys(s3_client, bucket, f"ckpt/{NS}/step_1/")
    tier = S3Tier.from_config(config)
    try:
        tier.put_file(3, "dead-save", "__0_0.distcp", b"x" * 1000)  # a drain that died before its marker
    finally:
        tier.close()
    upload_key = f"ckpt/{NS}/step_5/__0_0.distcp"
    upload = s3_client.create_multipart_upload(Bucket=bucket, Key=upload_key)["UploadId"]
    s3_client.upload_part(Bucket=bucket, Key=upload_key, UploadId=upload, PartNumber=1, Body=b"y" * 5000)

    young = cli(*argv, "gc")  # default --min-age: all of it may be a save in progress
    assert young.rc == 0 and "nothing to delete" in young.out
    assert re.search(r"^keep\s+durable\s+marker-less step .*step_3\s+\(younger than --min-age", young.out, re.M)
    assert re.search(rf"^keep\s+durable\s+aborted upload .*{upload_key}\s+\(younger", young.out, re.M)

    dry = cli(*argv, "gc", "--min-age", "0")
    assert dry.rc == 0 and "dry run: 2 item(s)" in dry.out
    assert _keys(s3_client, bucket, f"ckpt/{NS}/step_3/") == [f"ckpt/{NS}/step_3/__0_0.distcp"]

    done = cli(*argv, "gc", "--min-age", "0", "--yes")
    assert done.rc == 0, done.err
    assert re.search(rf"^delete\s+durable\s+marker-less step\s+1000 B\s+s3://{bucket}/ckpt/{NS}/step_3$", done.out, re.M)
    assert re.search(rf"^delete\s+durable\s+aborted upload\s+4\.9 KiB\s+s3://{bucket}/{upload_key}$", done.out, re.M)
    assert _keys(s3_client, bucket, f"ckpt/{NS}/step_3/") == []
    assert s3_client.list_multipart_uploads(Bucket=bucket, Prefix=f"ckpt/{NS}/").get("Uploads", []) == []
    assert _keys(s3_client, bucket, f"ckpt/{NS}/step_1/") == committed
    assert cli(*argv, "verify", "1").rc == 0


def test_ls_of_an_unknown_namespace_names_the_ones_on_s3(config, argv, cli, empty_memory) -> None:  # type: ignore[no-untyped-def]
    with Checkpointer(config) as ck:
        ck.save(1, model_state(1), durable=True).result(60)
    r = cli("ls", "--namespace", "run2", "--memory-dir", empty_memory, "--durable-url", config.durable_url)
    assert r.rc == 3 and "namespace 'run2' does not exist" in r.err and f"namespaces that exist: {NS}" in r.err
    listed = cli("ls", "--memory-dir", empty_memory, "--durable-url", config.durable_url, "--namespace", NS)
    assert listed.rc == 0 and re.search(r"^durable\s+1 committed", listed.out, re.M)
    assert Path(empty_memory).exists()


def test_export_from_s3_alone_is_bitwise(config, argv, cli, empty_memory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file

    with Checkpointer(config) as ck:
        ck.save(8, model_state(8), durable=True).result(60)
    r = cli("export", "8", "--to", str(tmp_path / "hf"), "--prefix", "model", "--namespace", NS,
            "--memory-dir", empty_memory, "--durable-url", config.durable_url)
    assert r.rc == 0, r.err
    assert "metadata from the durable tier" in r.out
    got = load_file(tmp_path / "hf" / "model.safetensors")
    want = model_state(8)["model"]
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert torch.equal(got[key].view(torch.uint8), tensor.view(torch.uint8)), key
