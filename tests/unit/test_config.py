from __future__ import annotations

import dataclasses

import pytest

from tierckpt import CheckpointConfig, ConfigError
from tierckpt.config import DurableLocation


@pytest.mark.parametrize("ns", ["", "../x", "a/b", "x" * 129, "has space", "dot.ted", "ü", "a\nb"])
def test_bad_namespace(ns: str) -> None:
    with pytest.raises(ConfigError, match="namespace"):
        CheckpointConfig(namespace=ns)


def test_namespace_message_says_what_is_allowed() -> None:
    with pytest.raises(ConfigError, match="letters, digits, '-' and '_'"):
        CheckpointConfig(namespace="a/b")


@pytest.mark.parametrize("ns", ["a", "llama-8b_run3", "x" * 128])
def test_good_namespace(ns: str) -> None:
    assert CheckpointConfig(namespace=ns).namespace == ns


@pytest.mark.parametrize(
    "url, match",
    [
        ("ftp://host/x", "not supported"),
        ("gs://bucket/x", "not supported"),
        ("/mnt/ckpt", "no scheme"),
        ("file://otherhost/mnt", "names host"),
        ("file://", "absolute path"),
        ("s3://", "bucket"),
        ("s3://Bad_Bucket/x", "bucket"),
        ("s3://ab/x", "bucket"),
        ("s3://bucket/a//b", "malformed"),
        ("", "non-empty"),
    ],
)
def test_bad_durable_url(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CheckpointConfig(namespace="n", durable_url=url)


def test_durable_url_parsing() -> None:
    assert DurableLocation.parse("file:///mnt/fsx/ckpt").path.as_posix() == "/mnt/fsx/ckpt"  # type: ignore[union-attr]
    loc = DurableLocation.parse("s3://my-bucket/a/b/")
    assert (loc.bucket, loc.prefix, str(loc)) == ("my-bucket", "a/b", "s3://my-bucket/a/b")


@pytest.mark.parametrize(
    "field, value",
    [("memory_steps_retained", 0), ("memory_steps_retained", 1.5), ("durable_every_n_steps", -1),
     ("durable_steps_retained", 0), ("memory_budget_bytes", 0), ("io_threads", 0), ("memory_dir", "rel/dir"),
     ("memory_steps_retained", True)],
)
def test_bad_numbers(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        CheckpointConfig(namespace="n", **{field: value})


def test_frozen_and_replace() -> None:
    cfg = CheckpointConfig(namespace="n")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.namespace = "m"  # type: ignore[misc]
    assert cfg.replace(memory_steps_retained=5).memory_steps_retained == 5
    with pytest.raises(ConfigError, match="unknown"):
        cfg.replace(no_such_field=1)
    with pytest.raises(ConfigError, match="namespace"):
        cfg.replace(namespace="a b")


def test_positional_arguments_are_refused() -> None:
    with pytest.raises(TypeError):
        CheckpointConfig("n")  # type: ignore[misc]


def test_from_env() -> None:
    env = {"TIERCKPT_NAMESPACE": "envns", "TIERCKPT_MEMORY_STEPS_RETAINED": "3", "TIERCKPT_DURABLE_URL": "file:///d"}
    cfg = CheckpointConfig.from_env(env)
    assert (cfg.namespace, cfg.memory_steps_retained, cfg.durable_url) == ("envns", 3, "file:///d")
    assert CheckpointConfig.from_env(env, namespace="override").namespace == "override"
    with pytest.raises(ConfigError, match="TIERCKPT_NAMESPACE"):
        CheckpointConfig.from_env({})
    with pytest.raises(ConfigError, match="TIERCKPT_IO_THREADS"):
        CheckpointConfig.from_env({"TIERCKPT_NAMESPACE": "n", "TIERCKPT_IO_THREADS": "many"})
