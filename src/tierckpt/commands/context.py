"""What every storage command shares: the global options, the config, the tiers, step look-up.

Call order in a command's ``main(args)``: ``config_from(args)`` → ``open_tiers(config)`` →
``copies_of(tiers, step)`` / ``tier.list_steps()`` → print → ``close_tiers(tiers)``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from tierckpt import layout
from tierckpt.config import CheckpointConfig, validate_namespace
from tierckpt.errors import CheckpointNotFoundError, ConfigError, IntegrityError, StorageError
from tierckpt.tiers import StepListing, Tier, open_durable, open_memory

__all__ = [
    "add_storage_options", "config_from", "copies_of", "human", "namespaces", "open_tiers", "step_arg", "tiers_of",
]


def add_storage_options(p: argparse.ArgumentParser, *, top_level: bool) -> None:
    """``--namespace``, ``--memory-dir``, ``--durable-url``: on the top parser and on each subcommand.

    A subcommand's copies default to SUPPRESS, so a value given before the subcommand is not
    overwritten by the subcommand's default: the options work before or after it.
    """
    default = None if top_level else argparse.SUPPRESS
    g = p.add_argument_group("storage (before or after the command)")
    g.add_argument("--namespace", default=default, metavar="NS", help="the run's namespace (else $TIERCKPT_NAMESPACE)")
    g.add_argument("--memory-dir", default=default, metavar="DIR",
                   help="memory tier root (else $TIERCKPT_MEMORY_DIR, else /dev/shm/tierckpt)")
    g.add_argument("--durable-url", default=default, metavar="URL",
                   help="file:///path or s3://bucket/prefix (else $TIERCKPT_DURABLE_URL; none: memory only)")


def step_arg(text: str) -> int:
    """argparse type for STEP: a whole number >= 0."""
    try:
        return layout.validate_step(int(text))
    except (ValueError, ConfigError):
        raise argparse.ArgumentTypeError(f"STEP must be a whole number >= 0, got {text!r}") from None


def config_from(args: argparse.Namespace, *, namespace: str | None = None) -> CheckpointConfig:
    """The config from the options, else the environment; ConfigError (exit 2) names what is missing."""
    ns = namespace or getattr(args, "namespace", None)
    memory_dir = getattr(args, "memory_dir", None)
    if memory_dir is not None:  # a relative path on the command line means the working directory
        args.memory_dir = memory_dir = os.path.abspath(memory_dir)
    try:
        return CheckpointConfig.from_env(namespace=ns, memory_dir=memory_dir, durable_url=getattr(args, "durable_url", None))
    except ConfigError as exc:
        if ns is not None or "no namespace" not in str(exc):
            raise
        probe = CheckpointConfig.from_env(namespace="tierckpt-probe", memory_dir=getattr(args, "memory_dir", None),
                                          durable_url=getattr(args, "durable_url", None))
        raise ConfigError(f"{exc}{_existing_hint(probe)}") from exc


def open_tiers(config: CheckpointConfig) -> list[Tier]:
    """The memory tier, then the durable tier when one is configured (reading order)."""
    durable = open_durable(config)
    return [open_memory(config)] + ([durable] if durable is not None else [])


def close_tiers(tiers: list[Tier]) -> None:
    for tier in tiers:
        closer = getattr(tier, "close", None)
        if closer is not None:
            closer()


@contextmanager
def tiers_of(config: CheckpointConfig) -> Iterator[list[Tier]]:
    tiers = open_tiers(config)
    try:
        yield tiers
    finally:
        close_tiers(tiers)


def copies_of(tiers: list[Tier], step: int, *, committed_only: bool = True) -> list[tuple[Tier, StepListing]]:
    """Each tier's listing of ``step`` (fastest tier first)."""
    out = []
    for tier in tiers:
        for s in tier.list_steps(include_uncommitted=not committed_only):
            if s.step == step:
                out.append((tier, s))
    return out


def require_copies(config: CheckpointConfig, tiers: list[Tier], step: int) -> list[tuple[Tier, StepListing]]:
    """The committed copies of ``step``; CheckpointNotFoundError (exit 3) naming the steps there are."""
    found = copies_of(tiers, step)
    if found:
        return found
    known = sorted({s.step for t in tiers for s in t.list_steps()})
    if known:
        hint = "committed steps: " + ", ".join(map(str, known))
    else:
        hint = f"namespace {config.namespace!r} has no committed step{_existing_hint(config)}"
    raise CheckpointNotFoundError(f"step {step} of namespace {config.namespace!r} is in no tier ({hint})", step=step)


def namespaces(config: CheckpointConfig) -> dict[str, list[str]]:
    """Namespaces that exist, per tier name (whatever the config's own namespace)."""
    out = {"memory": _dir_namespaces(config.memory_dir)}
    loc = config.durable
    if loc is not None and loc.scheme == "file" and loc.path is not None:
        out["durable"] = _dir_namespaces(str(loc.path))
    elif loc is not None and loc.scheme == "s3":
        out["durable"] = _s3_namespaces(config)
    return out


def _existing_hint(config: CheckpointConfig) -> str:
    found = sorted({ns for names in namespaces(config).values() for ns in names})
    where = config.memory_dir + (f" and {config.durable_url}" if config.durable_url else "")
    if not found:
        return f"; no namespace exists under {where}"
    return f"; namespaces under {where}: " + ", ".join(found)


def _dir_namespaces(root: str) -> list[str]:
    try:
        entries = os.scandir(root)
    except OSError:  # absent or unreadable: nothing to list
        return []
    with entries:
        return sorted(e.name for e in entries if e.is_dir() and not e.name.startswith(".") and _valid(e.name))


def _s3_namespaces(config: CheckpointConfig) -> list[str]:
    from tierckpt.tiers.s3 import S3Tier

    tier = S3Tier.from_config(config)
    base = tier.prefix + "/" if tier.prefix else ""
    names: list[str] = []
    token: str | None = None
    try:
        while True:
            kwargs: dict[str, Any] = {"Bucket": tier.bucket, "Prefix": base, "Delimiter": "/"}
            if token:
                kwargs["ContinuationToken"] = token
            page = tier.retrier.call(partial(tier.client.list_objects_v2, **kwargs), what="listing", key=base)
            for p in page.get("CommonPrefixes", ()):
                name = str(p["Prefix"])[len(base) :].rstrip("/")
                if _valid(name):
                    names.append(name)
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return sorted(names)
    finally:
        tier.close()


def _valid(name: str) -> bool:
    try:
        validate_namespace(name)
    except ConfigError:
        return False
    return True


def human(n: float) -> str:
    """Bytes for people: ``512 B``, ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def read_step(tier: Tier, step: int, namespace: str) -> tuple[layout.Manifest, Any]:
    """A committed copy's manifest and DCP metadata, both verified (IntegrityError if not)."""
    from tierckpt.record import loads_metadata
    from tierckpt.tiers.integrity import sealed_manifest, verified_metadata

    manifest = sealed_manifest(tier, step, namespace)
    metadata = loads_metadata(verified_metadata(tier, manifest), where=f"{tier.location(step)}/{layout.METADATA}")
    return manifest, metadata


def read_first(copies: list[Tier], step: int, namespace: str) -> tuple[layout.Manifest, Any, str]:
    """``read_step`` from the first copy that reads and verifies: (manifest, metadata, tier name)."""
    errors = []
    for tier in copies:
        try:
            manifest, metadata = read_step(tier, step, namespace)
            return manifest, metadata, tier.name
        except (IntegrityError, StorageError, CheckpointNotFoundError) as exc:
            errors.append(f"{tier.name}: {exc}")
    raise IntegrityError(f"step {step}: no copy has a readable manifest and metadata ({'; '.join(errors)})", step=step)


def saved_at(tier: Tier, step: int) -> float | None:
    """When the copy was committed (its marker's time, seconds since the epoch), if the tier tells."""
    step_dir = getattr(tier, "step_dir", None)
    if step_dir is not None:
        try:
            return os.stat(step_dir(step) / layout.MARKER).st_mtime
        except OSError:
            return None
    client, bucket, key = getattr(tier, "client", None), getattr(tier, "bucket", None), getattr(tier, "key", None)
    if client is None or bucket is None or key is None:
        return None
    try:
        return float(client.head_object(Bucket=bucket, Key=key(step, layout.MARKER))["LastModified"].timestamp())
    except Exception:  # only a label: a failed HEAD leaves it out rather than failing the command
        return None
