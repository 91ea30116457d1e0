"""The on-storage layout: the one place that knows file and key names.

    <tier root>/<namespace>/step_<N>/
        __<rank>_0.distcp   a rank's data: DCP-compatible records (torch.save archives)
        .metadata           DCP Metadata (the global plan), pickled with torch classes only
        manifest.json       files, sizes, per-item xxh3-128 checksums, world size, save id
        COMMITTED           written last: {"save_id", "manifest_xxh3"}; no marker, no step
    <tier root>/<namespace>/.staging/step_<N>.<save_id>/   a save in progress (invisible)
    <tier root>/<namespace>/.trash/                        steps being deleted
    <memory root>/<namespace>/.slots/rank_<r>/slot_<k>     reusable shared-memory slots
    <memory root>/<namespace>/.pins/                       links that keep a slot busy
    <memory root>/.agent.sock                              the node agent's local socket (if one runs)
    <memory root>/.replicas/<node id>/<namespace>/step_<N>/  replicas of another node's files (agent)
    <memory root>/.peer/<namespace>/step_<N>/              files fetched from peers for a load (agent)

State-dict keys: a key segment ``__rank<r>__`` (``rank_item_key``) marks an item that belongs to
rank r alone (a data loader's position, ``tierckpt.data``): every rank saves its own under its own
key, so DCP never deduplicates it, and a load asks for its own rank's key only; the others' keys
are not "unloaded", and a rank that did not exist when the step was saved finds none (its owner
then falls back to the replicated part, e.g. the loader's global position).

A small file replaced in place (the launcher's restart state, an address file, a pointer) is
written under ``temp_name`` beside it and renamed over it (``write_atomic``): the name is unique
to the writer (process, thread, call), so processes that share a directory, e.g. two agents on
one memory root, never rename each other's half-written file.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from tierckpt.errors import ConfigError, IntegrityError

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "MARKER",
    "METADATA",
    "Manifest",
    "checksum",
    "data_file_name",
    "is_rank_item",
    "parse_step_dir",
    "rank_item_key",
    "step_dir_name",
    "step_from_path",
    "temp_name",
    "validate_step",
    "write_atomic",
]

FORMAT_VERSION = 1
MARKER = "COMMITTED"
MANIFEST = "manifest.json"
METADATA = ".metadata"
STAGING = ".staging"
TRASH = ".trash"
SLOTS = ".slots"
PINS = ".pins"
AGENT_SOCKET = ".agent.sock"
REPLICAS = ".replicas"
PEER_CACHE = ".peer"
_STEP_DIR_RE = re.compile(r"step_(0|[1-9][0-9]*)")


def checksum(data: Any) -> str:
    """xxh3-128 of a bytes-like object, as 32 hex digits (releases the GIL while hashing)."""
    return xxhash.xxh3_128_hexdigest(data)


def validate_step(step: object) -> int:
    """Return ``step`` if it is a whole number >= 0, else raise ConfigError."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise ConfigError(f"step must be a whole number, got {step!r}")
    if step < 0:
        raise ConfigError(f"step must be >= 0, got {step}")
    return step


def step_dir_name(step: int) -> str:
    return f"step_{validate_step(step)}"


def parse_step_dir(name: str) -> int | None:
    """``'step_12'`` → 12; anything else (staging names, ``step_012``) → None."""
    m = _STEP_DIR_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def step_from_path(path: object) -> int | None:
    """The step named by the last ``step_<N>`` component of a path or URL, else None.

    ``'run/step_100'`` → 100, ``'s3://b/p/ns/step_7/'`` → 7, ``'ckpt-step_3'`` → None.
    """
    text = str(path).replace("\\", "/")
    found = [parse_step_dir(part) for part in text.split("/")]
    steps = [s for s in found if s is not None]
    return steps[-1] if steps else None


def data_file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


_RANK_ITEM_RE = re.compile(r"(?:^|\.)__rank(0|[1-9][0-9]*)__(?:\.|$)")


def rank_item_key(rank: int) -> str:
    """The state-dict key segment of an item that belongs to ``rank`` alone (see the module doc)."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ConfigError(f"rank must be an int >= 0, got {rank!r}")
    return f"__rank{rank}__"


def is_rank_item(fqn: str) -> bool:
    """Whether a flattened state-dict key is (inside) a per-rank item."""
    return _RANK_ITEM_RE.search(fqn) is not None


def staging_dir_name(step: int, save_id: str) -> str:
    return f"{step_dir_name(step)}.{save_id}"


@dataclass(frozen=True)
class ItemRecord:
    """Where one saved item lives inside a data file, and its checksum.

    ``data_offset`` is the offset of the raw tensor bytes inside the item's record
    (-1 for byte items and records tierckpt did not write); ``xxh3`` covers the whole
    record ``[offset, offset + length)``.
    """

    file: str
    offset: int
    length: int
    data_offset: int
    xxh3: str


@dataclass(frozen=True)
class Manifest:
    """A committed step's table of contents; serialised to ``manifest.json``."""

    namespace: str
    step: int
    save_id: str
    world_size: int
    metadata_xxh3: str
    files: Mapping[str, int]
    items: tuple[ItemRecord, ...] = field(default=())
    format_version: int = FORMAT_VERSION

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {
            "format_version": self.format_version,
            "namespace": self.namespace,
            "step": self.step,
            "save_id": self.save_id,
            "world_size": self.world_size,
            "metadata_xxh3": self.metadata_xxh3,
            "files": dict(sorted(self.files.items())),
            "items": [
                [i.file, i.offset, i.length, i.data_offset, i.xxh3] for i in self.items
            ],
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, *, where: str = "manifest") -> Manifest:
        try:
            body = json.loads(raw)
            if body["format_version"] > FORMAT_VERSION:
                raise IntegrityError(
                    f"{where} has format version {body['format_version']}; this tierckpt "
                    f"reads up to {FORMAT_VERSION}: upgrade tierckpt"
                )
            return cls(
                namespace=str(body["namespace"]),
                step=int(body["step"]),
                save_id=str(body["save_id"]),
                world_size=int(body["world_size"]),
                metadata_xxh3=str(body["metadata_xxh3"]),
                files={str(k): int(v) for k, v in body["files"].items()},
                items=tuple(ItemRecord(str(f), int(o), int(n), int(d), str(h)) for f, o, n, d, h in body["items"]),
                format_version=int(body["format_version"]),
            )
        except IntegrityError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"{where} is malformed: {exc}") from exc

    def item_index(self) -> dict[tuple[str, int], ItemRecord]:
        return {(i.file, i.offset): i for i in self.items}


def marker_bytes(save_id: str, manifest_raw: bytes) -> bytes:
    return json.dumps({"save_id": save_id, "manifest_xxh3": checksum(manifest_raw)}).encode()


def check_marker(marker_raw: bytes, manifest_raw: bytes, *, where: str) -> str:
    """Verify that a marker seals this manifest; return the save id, else IntegrityError."""
    try:
        body = json.loads(marker_raw)
        save_id, expected = str(body["save_id"]), str(body["manifest_xxh3"])
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"{where}: commit marker is malformed") from exc
    if checksum(manifest_raw) != expected:
        raise IntegrityError(f"{where}: manifest does not match its commit marker")
    return save_id


def temp_name(name: str) -> str:
    """A hidden name for a file being written to replace ``name`` in the same directory, unique
    to this process, thread and call (``.<name>.tmp-<pid>-<thread>-<random>``)."""
    return f".{name}.tmp-{os.getpid()}-{threading.get_ident():x}-{os.urandom(4).hex()}"


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Replace the file ``path`` with ``data`` in one rename: a reader sees the old or the new
    content, never a part; concurrent writers each rename their own ``temp_name`` (the last one
    wins). The temporary file is removed when the write or the rename fails."""
    final = os.fspath(path)
    tmp = os.path.join(os.path.dirname(final), temp_name(os.path.basename(final)))
    raw = data.encode() if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
