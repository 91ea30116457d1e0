"""Configuration values for tierckpt: frozen, keyword-only, validated on construction.

This is the only module that reads the environment (``CheckpointConfig.from_env``);
everything else receives a config value.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from tierckpt.errors import ConfigError

__all__ = ["CheckpointConfig", "DurableLocation", "S3Settings", "validate_namespace"]

_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
DEFAULT_MEMORY_DIR = "/dev/shm/tierckpt"


def validate_namespace(namespace: object) -> str:
    """Return ``namespace`` if it is ``[A-Za-z0-9_-]{1,128}``, else raise ConfigError."""
    if not isinstance(namespace, str):
        raise ConfigError(f"namespace must be a string, got {type(namespace).__name__}")
    if not namespace:
        raise ConfigError("namespace must not be empty; use e.g. 'llama-8b-run3'")
    if len(namespace) > 128:
        raise ConfigError(
            f"namespace is {len(namespace)} characters long; the limit is 128"
        )
    if not _NAMESPACE_RE.fullmatch(namespace):
        raise ConfigError(
            f"namespace {namespace!r} may contain only letters, digits, '-' and '_'"
        )
    return namespace


@dataclass(frozen=True, kw_only=True)
class S3Settings:
    """Explicit S3 overrides; ``None`` fields come from the standard AWS chain."""

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    part_size: int = 32 * 1024 * 1024
    max_concurrency: int = 8
    max_attempts: int = 8
    retry_deadline_s: float = 120.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.part_size < 5 * 1024 * 1024:
            raise ConfigError(
                f"s3.part_size is {self.part_size} bytes; S3 needs at least 5 MiB (5242880)"
            )
        for name in ("max_concurrency", "max_attempts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"s3.{name} must be at least 1")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError(
                "s3.access_key_id and s3.secret_access_key must be given together"
            )


@dataclass(frozen=True)
class DurableLocation:
    """A parsed ``durable_url``: ``scheme`` is 'file' (``path`` set) or 's3' (``bucket``, ``prefix``)."""

    scheme: str
    path: Path | None = None
    bucket: str | None = None
    prefix: str = ""

    @classmethod
    def parse(cls, url: str) -> DurableLocation:
        if not isinstance(url, str) or not url:
            raise ConfigError("durable_url must be a non-empty string such as 'file:///mnt/ckpt'")
        parsed = urlparse(url)
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise ConfigError(
                    f"durable_url {url!r} names host {parsed.netloc!r}; a file URL must be "
                    "'file:///absolute/path' (mount remote storage and use its local path)"
                )
            path = unquote(parsed.path)
            if not path.startswith("/"):
                raise ConfigError(f"durable_url {url!r} must hold an absolute path")
            return cls(scheme="file", path=Path(path))
        if parsed.scheme == "s3":
            bucket = parsed.netloc
            if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket or ""):
                raise ConfigError(
                    f"durable_url {url!r} has no valid bucket name; use 's3://bucket/prefix' "
                    "(3-63 lowercase letters, digits, '.' and '-')"
                )
            prefix = parsed.path.strip("/")
            if "//" in prefix or parsed.query or parsed.fragment:
                raise ConfigError(f"durable_url {url!r} is malformed; use 's3://bucket/prefix'")
            return cls(scheme="s3", bucket=bucket, prefix=prefix)
        if not parsed.scheme:
            raise ConfigError(
                f"durable_url {url!r} has no scheme; use 'file://{os.path.abspath(url)}' "
                "or 's3://bucket/prefix'"
            )
        raise ConfigError(
            f"durable_url scheme {parsed.scheme!r} is not supported; use 'file://' or 's3://'"
        )

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.path}"
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Everything a Checkpointer, writer or reader needs to know.

    namespace              the run's name: ``[A-Za-z0-9_-]{1,128}``
    memory_dir             node-local memory tier root (a tmpfs such as /dev/shm)
    durable_url            ``file:///path`` or ``s3://bucket/prefix``; None = memory only
    memory_steps_retained  newest N committed steps kept in memory (N >= 1)
    durable_every_n_steps  the durable policy: saves with ``durable=None`` go durable when
                           ``step % N == 0``; 0 = only when asked (``durable=True``)
    durable_steps_retained newest M durable steps kept; None keeps all
    memory_budget_bytes    most bytes of shared memory one rank's slots may hold; None = no cap
                           beyond the free space of ``memory_dir``
    io_threads             threads for checksums and durable copies
    local_mode             collective-free mode: each rank saves and loads only its own shards
                           (namespace ``<namespace>--rank<r>``), same sharding on load
    s3                     explicit S3 overrides (endpoint, credentials, part size)
    logger                 a logger that receives tierckpt's records too
    trusted                load non-tensor objects without the allow-list (only for checkpoints
                           whose writers you trust: unpickling can run code)
    allowed_classes        classes/functions a load may unpickle beyond the allow-list
    """

    namespace: str
    memory_dir: str = DEFAULT_MEMORY_DIR
    durable_url: str | None = None
    memory_steps_retained: int = 2
    durable_every_n_steps: int = 1
    durable_steps_retained: int | None = None
    memory_budget_bytes: int | None = None
    io_threads: int = 4
    local_mode: bool = False
    s3: S3Settings = field(default_factory=S3Settings)
    logger: logging.Logger | None = None
    trusted: bool = False
    allowed_classes: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        validate_namespace(self.namespace)
        if not isinstance(self.memory_dir, str) or not os.path.isabs(self.memory_dir):
            raise ConfigError(f"memory_dir must be an absolute path, got {self.memory_dir!r}")
        if self.durable_url is not None:
            DurableLocation.parse(self.durable_url)
        _check_int("memory_steps_retained", self.memory_steps_retained, minimum=1)
        _check_int("durable_every_n_steps", self.durable_every_n_steps, minimum=0)
        if self.durable_steps_retained is not None:
            _check_int("durable_steps_retained", self.durable_steps_retained, minimum=1)
        if self.memory_budget_bytes is not None:
            _check_int("memory_budget_bytes", self.memory_budget_bytes, minimum=1)
        _check_int("io_threads", self.io_threads, minimum=1)
        if not isinstance(self.local_mode, bool):
            raise ConfigError(f"local_mode must be True or False, got {self.local_mode!r}")
        if not isinstance(self.s3, S3Settings):
            raise ConfigError("s3 must be a tierckpt.config.S3Settings")
        if self.logger is not None and not isinstance(self.logger, logging.Logger):
            raise ConfigError("logger must be a logging.Logger or None")
        if not isinstance(self.trusted, bool):
            raise ConfigError(f"trusted must be True or False, got {self.trusted!r}")
        if not isinstance(self.allowed_classes, tuple) or not all(callable(c) for c in self.allowed_classes):
            raise ConfigError("allowed_classes must be a tuple of classes or functions, e.g. (MyState,)")

    @property
    def durable(self) -> DurableLocation | None:
        """The parsed durable location, or None when the config is memory-only."""
        return None if self.durable_url is None else DurableLocation.parse(self.durable_url)

    def rank_local(self, rank: int) -> CheckpointConfig:
        """The config of rank ``rank``'s own checkpoints in local mode (namespace ``<ns>--rank<r>``)."""
        local_ns = f"{self.namespace}--rank{rank}"
        if len(local_ns) > 128:
            raise ConfigError(
                f"local_mode needs namespace + '--rank{rank}' to fit in 128 characters; "
                f"shorten namespace {self.namespace!r}"
            )
        return self.replace(namespace=local_ns, local_mode=False)

    def replace(self, **changes: Any) -> CheckpointConfig:
        """A copy with ``changes`` applied (and validated); unknown fields are errors."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ConfigError(f"unknown CheckpointConfig field(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> CheckpointConfig:
        """Build a config from ``TIERCKPT_*`` variables, then apply ``overrides``.

        TIERCKPT_NAMESPACE, TIERCKPT_MEMORY_DIR, TIERCKPT_DURABLE_URL,
        TIERCKPT_MEMORY_STEPS_RETAINED, TIERCKPT_DURABLE_EVERY_N_STEPS,
        TIERCKPT_DURABLE_STEPS_RETAINED, TIERCKPT_MEMORY_BUDGET_BYTES, TIERCKPT_IO_THREADS;
        S3 overrides: TIERCKPT_S3_PART_SIZE, TIERCKPT_S3_MAX_CONCURRENCY.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, conv in (
            ("namespace", str),
            ("memory_dir", str),
            ("durable_url", str),
            ("memory_steps_retained", int),
            ("durable_every_n_steps", int),
            ("durable_steps_retained", int),
            ("memory_budget_bytes", int),
            ("io_threads", int),
        ):
            raw = env.get(f"TIERCKPT_{name.upper()}")
            if raw is not None and raw != "":
                try:
                    values[name] = conv(raw)
                except ValueError:
                    raise ConfigError(f"TIERCKPT_{name.upper()}={raw!r} is not a valid {conv.__name__}") from None
        s3_values: dict[str, Any] = {}
        for name in ("part_size", "max_concurrency"):
            raw = env.get(f"TIERCKPT_S3_{name.upper()}")
            if raw:
                try:
                    s3_values[name] = int(raw)
                except ValueError:
                    raise ConfigError(f"TIERCKPT_S3_{name.upper()}={raw!r} is not a whole number") from None
        if s3_values and "s3" not in overrides:
            values["s3"] = S3Settings(**s3_values)
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "namespace" not in values:
            raise ConfigError("no namespace: pass --namespace or set TIERCKPT_NAMESPACE")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(f"unknown CheckpointConfig field(s): {', '.join(unknown)}")
        return cls(**values)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be a whole number, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")
