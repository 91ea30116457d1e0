"""The restart state an agent keeps beside the memory tier and the durable tier, so that it
survives a full job restart, on the same machines or on new ones.

``<memory-dir>/.tierckpt-run/<rdzv-id>.json`` and, with a durable tier and a namespace, a copy
at ``<durable>/<namespace>/.tierckpt-run/<rdzv-id>.json`` (``file://`` or ``s3://``): the next
generation, the restarts and full restarts done, when the job first started, the resume bound,
the hang profile, the repeat offenders and the backoff streak (``torch_agent.py`` ``_save_state``).

``RunState`` is the file's content as a typed value (``RunState.from_dict(load(...))``, and
``save(..., state.to_dict())``): malformed fields read as their defaults, never as an error.

Call order: ``load`` after each rendezvous, ``save`` before every restart and exit. ``load``
reads the node-local copy, and the durable copy only when there is no local one (a fresh
machine: the job's counts, deadlines and bounds go on from where the job was). ``save``
replaces the local copy atomically under a name unique to the writer (``layout.write_atomic``:
two agents on one memory root never share a temporary file), then the durable copy; a durable
copy that cannot be written is reported (the returned text), never fatal: the local one holds.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierckpt import layout
from tierckpt.errors import CheckpointNotFoundError, StorageError, TierckptError
from tierckpt.launcher.options import RunOptions

__all__ = ["STATE_DIR", "RunState", "load", "save"]

STATE_DIR = ".tierckpt-run"

log = logging.getLogger("tierckpt.run")

# the state file is written on the restart path: a failing S3 may delay a restart by this much, no more
_S3_ATTEMPTS = 3
_S3_DEADLINE_S = 5.0


@dataclass(frozen=True)
class RunState:
    """What survives a full job restart, with the file's keys (an empty file: the defaults).

    ``next_generation``, ``full_restarts``, ``restarts`` done in all; ``job_started`` (wall clock
    of the first start: activeDeadlineSeconds); ``hang`` (hang.Profile's dict); ``resume_before``
    (the NaN bound); ``membership_changes`` (arrivals, which cost no restart); ``offenses`` and
    ``avoid`` (avoid.py's repeat offenders and the last full restart's avoid list);
    ``unhealthy_before`` (the backoff streak, escalation.py); ``full_restart_at`` (wall clock of the
    full job restart this file was written for: the next incarnation's downtime starts there)."""

    next_generation: int = 0
    full_restarts: int = 0
    job_started: float | None = None
    hang: Mapping[str, Any] = field(default_factory=dict)
    restarts: int = 0
    resume_before: int | None = None
    membership_changes: int = 0
    offenses: Any = None
    avoid: tuple[Any, ...] = ()
    unhealthy_before: int = 0
    full_restart_at: float | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> RunState:
        def count(name: str) -> int:
            v = raw.get(name)
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0

        started, down = raw.get("job_started"), raw.get("full_restart_at")
        bound = raw.get("resume_before")
        hang, avoid = raw.get("hang"), raw.get("avoid")
        return cls(next_generation=count("next_generation"), full_restarts=count("full_restarts"),
                   job_started=float(started) if isinstance(started, (int, float)) and not isinstance(started, bool)
                   and math.isfinite(started) else None,
                   hang=dict(hang) if isinstance(hang, dict) else {}, restarts=count("restarts"),
                   resume_before=bound if isinstance(bound, int) and not isinstance(bound, bool) else None,
                   membership_changes=count("membership_changes"), offenses=raw.get("offenses"),
                   avoid=tuple(avoid) if isinstance(avoid, list) else (), unhealthy_before=count("unhealthy_before"),
                   full_restart_at=float(down) if isinstance(down, (int, float)) and not isinstance(down, bool)
                   and math.isfinite(down) else None)

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON object (the keys and their order as every earlier version wrote them)."""
        return {"next_generation": self.next_generation, "full_restarts": self.full_restarts,
                "job_started": self.job_started, "hang": dict(self.hang), "restarts": self.restarts,
                "resume_before": self.resume_before, "membership_changes": self.membership_changes,
                "offenses": self.offenses, "avoid": list(self.avoid), "unhealthy_before": self.unhealthy_before,
                "full_restart_at": self.full_restart_at}


def _memory_path(opts: RunOptions, run_id: str) -> Path | None:
    return Path(opts.memory_dir) / STATE_DIR / f"{run_id}.json" if opts.memory_dir else None


def _name(run_id: str) -> str:
    return f"{STATE_DIR}/{run_id}.json"


def _durable_file(opts: RunOptions, run_id: str) -> Path | None:
    url, ns = opts.durable_url, opts.namespace
    if not url or not ns or not url.startswith("file://"):
        return None
    from tierckpt.config import DurableLocation

    root = DurableLocation.parse(url).path
    return None if root is None else root / ns / _name(run_id)


def _s3(opts: RunOptions, run_id: str) -> tuple[Any, str] | None:
    """(an S3 tier of the namespace, the state file's key), for an ``s3://`` durable tier."""
    url, ns = opts.durable_url, opts.namespace
    if not url or not ns or not url.startswith("s3://"):
        return None
    from tierckpt.config import CheckpointConfig, S3Settings
    from tierckpt.tiers.s3 import S3Tier

    settings = S3Settings(max_attempts=_S3_ATTEMPTS, retry_deadline_s=_S3_DEADLINE_S,
                          connect_timeout_s=_S3_DEADLINE_S, read_timeout_s=_S3_DEADLINE_S)
    tier = S3Tier.from_config(CheckpointConfig(namespace=ns, durable_url=url, s3=settings))
    return tier, tier.ns_key + _name(run_id)


def _parse(raw: bytes | str, where: str) -> dict[str, Any] | None:
    try:
        body = json.loads(raw)
    except ValueError:
        log.warning("restart state at %s does not parse; ignored", where)
        return None
    if not isinstance(body, dict):
        log.warning("restart state at %s is not a JSON object; ignored", where)
        return None
    return body


def load(opts: RunOptions, run_id: str) -> dict[str, Any]:
    """The node-local state; when there is none, the durable copy; {} when neither exists or parses."""
    p = _memory_path(opts, run_id)
    if p is not None:
        try:
            local = _parse(p.read_bytes(), str(p))
        except FileNotFoundError:
            local = None
        if local is not None:
            return local
    durable = _load_durable(opts, run_id)
    return durable if durable is not None else {}


def _load_durable(opts: RunOptions, run_id: str) -> dict[str, Any] | None:
    path = _durable_file(opts, run_id)
    if path is not None:
        try:
            return _parse(path.read_bytes(), str(path))
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("restart state at %s cannot be read (%s); the job starts without it", path, exc)
            return None
    try:
        s3 = _s3(opts, run_id)
        if s3 is None:
            return None
        tier, key = s3
        try:
            raw = tier.retrier.call(lambda: _get(tier, key), what="read", key=key)
        finally:
            tier.close()
    except CheckpointNotFoundError:
        return None
    except TierckptError as exc:
        log.warning("restart state at %s cannot be read (%s); the job starts without it", opts.durable_url, exc)
        return None
    return _parse(raw, f"s3://{tier.bucket}/{key}")


def _get(tier: Any, key: str) -> bytes:
    body = tier.client.get_object(Bucket=tier.bucket, Key=key)["Body"]
    try:
        return bytes(body.read())
    finally:
        body.close()


def save(opts: RunOptions, run_id: str, state: dict[str, Any]) -> str | None:
    """Write the state locally (atomically; an OSError propagates) and to the durable tier;
    returns what went wrong with the durable copy (the caller warns), or None."""
    body = json.dumps(state).encode()
    p = _memory_path(opts, run_id)
    if p is not None:
        p.parent.mkdir(parents=True, exist_ok=True)
        layout.write_atomic(p, body)
    path = _durable_file(opts, run_id)
    try:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            layout.write_atomic(path, body)
            return None
        s3 = _s3(opts, run_id)
        if s3 is not None:
            tier, key = s3
            try:
                tier.retrier.call(lambda: tier.client.put_object(Bucket=tier.bucket, Key=key, Body=body),
                                  what="upload", key=key, error=StorageError)
            finally:
                tier.close()
    except (OSError, TierckptError) as exc:
        return f"the durable copy of the restart state was not written ({opts.durable_url}): {exc}"
    return None
