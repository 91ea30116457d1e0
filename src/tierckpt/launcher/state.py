"""The restart state an agent keeps beside the memory tier, so that it survives a full job restart.

``<memory-dir>/.tierckpt-run/<rdzv-id>.json`` (and, for a ``file://`` durable tier,
``<durable>/<namespace>/.tierckpt-run/<rdzv-id>.json``): the next generation, the full
restarts done and when the job first started. Call order: ``load`` after each rendezvous,
``save`` before every restart and exit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tierckpt.launcher.options import RunOptions

__all__ = ["STATE_DIR", "load", "save"]

STATE_DIR = ".tierckpt-run"


def _memory_path(opts: RunOptions, run_id: str) -> Path | None:
    return Path(opts.memory_dir) / STATE_DIR / f"{run_id}.json" if opts.memory_dir else None


def _durable_path(opts: RunOptions, run_id: str) -> Path | None:
    url, ns = opts.durable_url, opts.namespace
    if not url or not ns or not url.startswith("file://"):
        return None  # S3: the memory-side copy only (documented)
    return Path(url[len("file://"):]) / ns / STATE_DIR / f"{run_id}.json"


def load(opts: RunOptions, run_id: str) -> dict[str, Any]:
    """The memory-side state ({} when there is none or it does not parse)."""
    p = _memory_path(opts, run_id)
    try:
        return dict(json.loads(p.read_text())) if p is not None else {}
    except (FileNotFoundError, ValueError):
        return {}


def save(opts: RunOptions, run_id: str, state: dict[str, Any]) -> None:
    body = json.dumps(state)
    p = _memory_path(opts, run_id)
    if p is not None:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(body)
        os.replace(tmp, p)
    durable = _durable_path(opts, run_id)
    if durable is not None:
        durable.parent.mkdir(parents=True, exist_ok=True)
        durable.write_text(body)
