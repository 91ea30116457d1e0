"""Configuration values for tierckpt: frozen, keyword-only, validated on construction.

This is the only module that reads the environment (``CheckpointConfig.from_env``, and the
launcher's settings that ``CheckpointConfig(...)`` takes for the fields its caller left
unset: ``launcher_settings``); everything else receives a config value.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from tierckpt import workerenv
from tierckpt.errors import ConfigError

__all__ = [
    "CheckpointConfig",
    "DurableLocation",
    "S3Settings",
    "launcher_settings",
    "node_ram_bytes",
    "parse_memory_budget",
    "validate_namespace",
]

_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
DEFAULT_MEMORY_DIR = "/dev/shm/tierckpt"

#: the variables ``tierckpt run`` exports to its workers, by the CheckpointConfig field they fill
LAUNCHER_ENV = {
    "namespace": workerenv.NAMESPACE,
    "memory_dir": workerenv.MEMORY_DIR,
    "durable_url": workerenv.DURABLE_URL,
    "resume_before": workerenv.RESUME_BEFORE,
}


class _Unset(str):
    """A field default that the launcher's environment may replace (the caller did not set it)."""


_NO_NAMESPACE = _Unset("")
_MEMORY_DIR_DEFAULT = _Unset(DEFAULT_MEMORY_DIR)
#: a ``memory_dir`` default for configs that build a CheckpointConfig (the compat APIs): it reads
#: as /dev/shm/tierckpt and still counts as unset, so ``tierckpt run --memory-dir`` applies
MEMORY_DIR_UNSET: str = _MEMORY_DIR_DEFAULT
_NO_DURABLE = _Unset("")  # durable_url left unset: the launcher's, else None (explicit None: memory only)
_replacing: ContextVar[bool] = ContextVar("tierckpt_config_replacing", default=False)


def launcher_settings(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings ``tierckpt run`` exported (``LAUNCHER_ENV``), by field name; unset ones absent.

    ``TIERCKPT_RESUME_BEFORE=N`` (set after a non-finite loss at step N) becomes ``resume_before``.
    """
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name, var in LAUNCHER_ENV.items():
        raw = env.get(var)
        if raw is None or raw == "":
            continue
        if name == "resume_before":
            try:
                out[name] = int(raw)
            except ValueError:
                raise ConfigError(f"{var}={raw!r} is not a whole number (the step of a non-finite loss)") from None
        else:
            out[name] = raw
    return out


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

    namespace              the run's name: ``[A-Za-z0-9_-]{1,128}``; unset: the launcher's
                           (``tierckpt run --namespace``, TIERCKPT_NAMESPACE)
    memory_dir             node-local memory tier root (a tmpfs such as /dev/shm); unset: the
                           launcher's (``--memory-dir``, TIERCKPT_MEMORY_DIR), else /dev/shm/tierckpt
    durable_url            ``file:///path`` or ``s3://bucket/prefix``; None = memory only; unset:
                           the launcher's (``--durable-url``, TIERCKPT_DURABLE_URL), else None
    memory_steps_retained  newest N committed steps kept in memory (N >= 1)
    durable_every_n_steps  the durable policy: saves with ``durable=None`` go durable when
                           ``step % N == 0``; 0 = only when asked (``durable=True``)
    durable_steps_retained newest M durable steps kept; None keeps all
    memory_budget_bytes    most bytes of shared memory one rank's slots may hold; None = no cap
                           beyond the free space of ``memory_dir``
    node_memory_budget     cap on everything the node's memory root holds (every local rank's
                           steps and slots, replicas, the peer cache): "40%" of the node's RAM
                           (20-100 %) or bytes (an int, or "64G"); saves evict the node's own
                           older steps to stay under it. None: the node agent's
                           ``--memory-budget`` when one runs, else no node cap
    io_threads             threads for checksums and durable copies
    local_mode             collective-free mode: each rank saves and loads only its own shards
                           (namespace ``<namespace>--rank<r>``), same sharding on load
    s3                     explicit S3 overrides (endpoint, credentials, part size)
    logger                 a logger that receives tierckpt's records too
    trusted                load non-tensor objects without the allow-list (only for checkpoints
                           whose writers you trust: unpickling can run code)
    allowed_classes        classes/functions a load may unpickle beyond the allow-list
    resume_before          ``load()`` without a step loads the newest step older than this one
                           (the launcher sets TIERCKPT_RESUME_BEFORE=N after a non-finite loss at
                           step N); None: the launcher's, else no bound

    Fields left unset take the launcher's settings; an explicit value that differs from the
    launcher's wins, with a warning naming both in a worker of ``tierckpt run`` (once per
    process and value).
    """

    namespace: str = _NO_NAMESPACE
    memory_dir: str = _MEMORY_DIR_DEFAULT
    durable_url: str | None = _NO_DURABLE
    memory_steps_retained: int = 2
    durable_every_n_steps: int = 1
    durable_steps_retained: int | None = None
    memory_budget_bytes: int | None = None
    node_memory_budget: int | str | None = None
    io_threads: int = 4
    local_mode: bool = False
    s3: S3Settings = field(default_factory=S3Settings)
    logger: logging.Logger | None = None
    trusted: bool = False
    allowed_classes: tuple[Any, ...] = ()
    resume_before: int | None = None

    def __post_init__(self) -> None:
        self._take_launcher_settings()
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
        if self.node_memory_budget is not None:
            parse_memory_budget(self.node_memory_budget, node_ram_bytes(), field="node_memory_budget")
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
        if self.resume_before is not None:
            _check_int("resume_before", self.resume_before, minimum=0)

    def _take_launcher_settings(self) -> None:
        """Fill the fields the caller left unset from ``tierckpt run``'s environment; warn on conflicts."""
        launcher = {} if _replacing.get() else launcher_settings()
        # a conflict is worth a warning only in a worker of tierckpt run (it sets the generation);
        # elsewhere (a shell's TIERCKPT_* for the CLI, the node agent) explicit values are just values
        in_worker = bool(launcher) and os.environ.get(workerenv.GENERATION) is not None
        unset = {"namespace": type(self.namespace) is _Unset, "memory_dir": type(self.memory_dir) is _Unset,
                 "durable_url": type(self.durable_url) is _Unset, "resume_before": self.resume_before is None}
        for name, is_unset in unset.items():
            value = getattr(self, name)
            if is_unset:
                value = launcher.get(name, None if name in ("durable_url", "resume_before") else str(value))
                object.__setattr__(self, name, value)
            elif in_worker and name in launcher and launcher[name] != value:
                warnings.warn(
                    f"CheckpointConfig({name}={value!r}) differs from the launcher's {LAUNCHER_ENV[name]}="
                    f"{launcher[name]!r} (tierckpt run); using {value!r}. Leave {name} unset to follow the "
                    "launcher (its agent, replicas and restart state use the launcher's settings)",
                    UserWarning, stacklevel=4,
                )
        if not self.namespace:
            raise ConfigError(
                "no namespace: pass CheckpointConfig(namespace='run1'), or run under "
                "`tierckpt run --namespace run1` (which exports TIERCKPT_NAMESPACE)"
            )

    @property
    def node_budget_bytes(self) -> int | None:
        """``node_memory_budget`` in bytes (a share of this node's RAM resolved here), or None."""
        if self.node_memory_budget is None:
            return None
        return parse_memory_budget(self.node_memory_budget, node_ram_bytes(), field="node_memory_budget")

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
        with _no_launcher():  # every field is already resolved: a derived copy is not a new conflict
            return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> CheckpointConfig:
        """Build a config from ``TIERCKPT_*`` variables, then apply ``overrides``.

        TIERCKPT_NAMESPACE, TIERCKPT_MEMORY_DIR, TIERCKPT_DURABLE_URL,
        TIERCKPT_MEMORY_STEPS_RETAINED, TIERCKPT_DURABLE_EVERY_N_STEPS,
        TIERCKPT_DURABLE_STEPS_RETAINED, TIERCKPT_MEMORY_BUDGET_BYTES, TIERCKPT_NODE_MEMORY_BUDGET,
        TIERCKPT_IO_THREADS,
        TIERCKPT_RESUME_BEFORE; S3 overrides: TIERCKPT_S3_PART_SIZE, TIERCKPT_S3_MAX_CONCURRENCY.
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
            ("node_memory_budget", str),
            ("io_threads", int),
            ("resume_before", int),
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
        with _no_launcher():  # the environment is read above (or the caller chose it); overrides win quietly
            return cls(**values)


_SIZE_RE = re.compile(r"(\d+)\s*([KMGT]i?B?|B)?", re.IGNORECASE)
_PERCENT_RE = re.compile(r"(\d+(?:\.\d+)?)\s*%")


def node_ram_bytes() -> int:
    """This node's physical memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def parse_memory_budget(value: object, total_bytes: int, *, field: str = "memory budget") -> int:
    """A budget as bytes: an int, "64G" / "512M" (powers of 1024), or "40%" of ``total_bytes`` (20-100 %)."""
    fix = f"{field}={value!r}: use a share of RAM such as '40%' (20-100 %) or bytes such as 64G"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(fix)
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"{field} must be at least 1 byte, got {value}")
        return value
    text = value.strip()
    if m := _PERCENT_RE.fullmatch(text):
        share = float(m.group(1))
        if not 20 <= share <= 100:
            raise ConfigError(f"{field}={value!r}: a share of RAM must be 20-100 %")
        return int(total_bytes * share / 100)
    if m := _SIZE_RE.fullmatch(text):
        unit = (m.group(2) or "B")[0].upper()
        n = int(m.group(1)) * 1024 ** "BKMGT".index(unit)
        if n >= 1:
            return n
    raise ConfigError(fix)


@contextmanager
def _no_launcher() -> Iterator[None]:
    token = _replacing.set(True)
    try:
        yield
    finally:
        _replacing.reset(token)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be a whole number, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")
