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


# -- the launcher's settings (tierckpt run exports TIERCKPT_*; issue 15 item 7) -------------------
_LAUNCHER = {"TIERCKPT_NAMESPACE": "job-ns", "TIERCKPT_MEMORY_DIR": "/dev/shm/launcher",
             "TIERCKPT_DURABLE_URL": "file:///launcher/durable", "TIERCKPT_RESUME_BEFORE": "40"}


def test_unset_fields_take_the_launchers_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in _LAUNCHER.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TIERCKPT_GENERATION", "2")
    cfg = CheckpointConfig()
    assert (cfg.namespace, cfg.memory_dir, cfg.durable_url, cfg.resume_before) == (
        "job-ns", "/dev/shm/launcher", "file:///launcher/durable", 40)
    assert type(cfg.namespace) is str and type(cfg.memory_dir) is str  # no sentinel leaks out
    cfg2 = CheckpointConfig(namespace="job-ns", memory_steps_retained=3)  # same value: no warning
    assert cfg2.memory_dir == "/dev/shm/launcher" and cfg2.memory_steps_retained == 3
    local = cfg.rank_local(1)  # a derived copy is no conflict (pytest turns warnings into errors)
    assert (local.namespace, local.memory_dir) == ("job-ns--rank1", "/dev/shm/launcher")


def test_without_the_launcher_the_defaults_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in _LAUNCHER:
        monkeypatch.delenv(key, raising=False)
    cfg = CheckpointConfig(namespace="n")
    assert (cfg.memory_dir, cfg.durable_url, cfg.resume_before) == ("/dev/shm/tierckpt", None, None)
    assert cfg == CheckpointConfig(namespace="n", memory_dir="/dev/shm/tierckpt", durable_url=None)
    with pytest.raises(ConfigError, match="tierckpt run --namespace"):
        CheckpointConfig()


def test_explicit_value_that_differs_wins_with_a_warning_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in _LAUNCHER.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TIERCKPT_GENERATION", raising=False)
    assert CheckpointConfig(namespace="other").namespace == "other"  # not a worker of tierckpt run: no warning
    monkeypatch.setenv("TIERCKPT_GENERATION", "0")  # a worker of tierckpt run
    with pytest.warns(UserWarning, match=r"memory_dir='/dev/shm/mine'.*TIERCKPT_MEMORY_DIR='/dev/shm/launcher'"):
        cfg = CheckpointConfig(memory_dir="/dev/shm/mine")
    assert (cfg.namespace, cfg.memory_dir) == ("job-ns", "/dev/shm/mine")
    with pytest.warns(UserWarning, match="TIERCKPT_DURABLE_URL"):
        memory_only = CheckpointConfig(durable_url=None)  # explicit None: memory only, on purpose
    assert memory_only.durable_url is None


def test_resume_before_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPT_RESUME_BEFORE", "soon")
    with pytest.raises(ConfigError, match="TIERCKPT_RESUME_BEFORE='soon'"):
        CheckpointConfig(namespace="n")
    monkeypatch.delenv("TIERCKPT_RESUME_BEFORE")
    with pytest.raises(ConfigError, match="resume_before"):
        CheckpointConfig(namespace="n", resume_before=-1)
    assert CheckpointConfig.from_env({"TIERCKPT_NAMESPACE": "n", "TIERCKPT_RESUME_BEFORE": "7"}).resume_before == 7
