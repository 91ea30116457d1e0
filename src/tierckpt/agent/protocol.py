"""The agent's peer protocol, sans I/O: framing, the handshake's MACs, request validation.

A connection between two agents (TCP) is a sequence of frames; bulk bytes follow a frame
that announced their sizes, unframed:

    frame   = MAGIC (4 bytes, b"TCK1") + body length (uint32, big-endian) + body (JSON object)
    server → hello   {op, node, nonce}                      on accept
    client → auth    {op, node, nonce, mac}                 mac = HMAC(secret, "c" | server nonce | client nonce)
    server → welcome {op, node, mac}                        mac = HMAC(secret, "s" | client nonce | server nonce)
    then requests, one at a time:
      list {ns}                     → listing {steps: [{step, origin, save_id, held: {name: size}, all: [names]}]}
      get  {ns, origin, step, name, [offset, length]}
                                    → file {size} + size raw bytes            (error when absent)
                                      with offset/length: that range of the file (parallel fetches)
      put  {ns, origin, step, save_id, files: [[name, size], ...], keep: [steps]}
           + the files' bytes in order                      → stored {} | error {message}
      status {}                     → status {...}

Every value that names storage is validated here (namespace and node id regexes, whole
numbers, file names from a fixed pattern), so no path ever comes from the wire. A frame
that breaks a rule raises ``ProtocolViolation``; the server then closes that connection
only. Bodies are at most ``MAX_BODY`` bytes, files at most ``MAX_FILE`` bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierckpt import layout
from tierckpt.config import validate_namespace
from tierckpt.errors import ConfigError

__all__ = [
    "HEADER",
    "MAGIC",
    "MAX_BODY",
    "MAX_FILE",
    "Get",
    "ListSteps",
    "ProtocolViolation",
    "Put",
    "Status",
    "client_mac",
    "decode_body",
    "encode",
    "parse_header",
    "parse_request",
    "server_mac",
    "validate_file_name",
    "validate_node_id",
]

MAGIC = b"TCK1"
HEADER = struct.Struct("!4sI")
MAX_BODY = 1 << 20
MAX_FILE = 1 << 40
SMALL_FILES = (layout.METADATA, layout.MANIFEST, layout.MARKER)  # a step's sealed files
MAX_SMALL = 64 << 20  # most bytes one of them may have
MAX_FILES = 4096
_NODE_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
_FILE_RE = re.compile(r"__[0-9]{1,9}_[0-9]{1,9}\.distcp|\.metadata|manifest\.json|COMMITTED")
_NONCE_RE = re.compile(r"[0-9a-f]{64}")


class ProtocolViolation(Exception):
    """A peer sent something the protocol does not allow; close that connection."""


def encode(message: Mapping[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_BODY:
        raise ProtocolViolation(f"message of {len(body)} bytes exceeds {MAX_BODY}")
    return HEADER.pack(MAGIC, len(body)) + body


def parse_header(raw: bytes) -> int:
    """The body length announced by an 8-byte header; ProtocolViolation if malformed."""
    if len(raw) != HEADER.size:
        raise ProtocolViolation("truncated header")
    magic, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolViolation("bad magic (not a tierckpt agent peer)")
    if length > MAX_BODY:
        raise ProtocolViolation(f"body of {length} bytes exceeds {MAX_BODY}")
    return int(length)


def decode_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolViolation(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("op"), str):
        raise ProtocolViolation("body must be an object with an 'op'")
    return body


# -- handshake ---------------------------------------------------------------------
def _mac(secret: bytes, tag: bytes, first: str, second: str) -> str:
    return hmac.new(secret, tag + bytes.fromhex(first) + bytes.fromhex(second), hashlib.sha256).hexdigest()


def client_mac(secret: bytes, server_nonce: str, client_nonce: str) -> str:
    return _mac(secret, b"c", server_nonce, client_nonce)


def server_mac(secret: bytes, client_nonce: str, server_nonce: str) -> str:
    return _mac(secret, b"s", client_nonce, server_nonce)


def check_mac(expected: str, got: object) -> None:
    if not isinstance(got, str) or not hmac.compare_digest(expected, got):
        raise ProtocolViolation("authentication failed (wrong or missing job secret)")


def validate_nonce(value: object) -> str:
    if not isinstance(value, str) or not _NONCE_RE.fullmatch(value):
        raise ProtocolViolation("nonce must be 64 lowercase hex digits")
    return value


# -- values ------------------------------------------------------------------------
def validate_node_id(value: object) -> str:
    if not isinstance(value, str) or not _NODE_RE.fullmatch(value):
        raise ProtocolViolation(f"node id {str(value)[:40]!r} must match [A-Za-z0-9_-]{{1,128}}")
    return value


def validate_file_name(value: object) -> str:
    if not isinstance(value, str) or not _FILE_RE.fullmatch(value):
        raise ProtocolViolation(f"file name {str(value)[:40]!r} is not a checkpoint file name")
    return value


def _ns(value: object) -> str:
    try:
        return validate_namespace(value)
    except ConfigError as exc:
        raise ProtocolViolation(str(exc)) from None


def _int(value: object, what: str, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise ProtocolViolation(f"{what} must be a whole number in 0..{limit}")
    return value


def _step(value: object) -> int:
    return _int(value, "step", 2**62)


# -- requests ----------------------------------------------------------------------
@dataclass(frozen=True)
class ListSteps:
    namespace: str


@dataclass(frozen=True)
class Get:
    namespace: str
    origin: str
    step: int
    name: str
    offset: int = 0
    length: int | None = None  # None: the whole file


@dataclass(frozen=True)
class Put:
    namespace: str
    origin: str
    step: int
    save_id: str
    files: tuple[tuple[str, int], ...]
    keep: frozenset[int]

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.files)


@dataclass(frozen=True)
class Status:
    pass


Request = ListSteps | Get | Put | Status
_SAVE_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def parse_request(body: Mapping[str, Any]) -> Request:
    """A validated request; ProtocolViolation for an unknown op or any bad field."""
    op = body.get("op")
    if op == "list":
        return ListSteps(_ns(body.get("ns")))
    if op == "get":
        length = body.get("length")
        return Get(_ns(body.get("ns")), validate_node_id(body.get("origin")), _step(body.get("step")),
                   validate_file_name(body.get("name")), _int(body.get("offset", 0), "offset", MAX_FILE),
                   None if length is None else _int(length, "length", MAX_FILE))
    if op == "put":
        files = body.get("files")
        if not isinstance(files, list) or not 0 < len(files) <= MAX_FILES:
            raise ProtocolViolation(f"files must be a list of 1..{MAX_FILES} [name, size] pairs")
        parsed: list[tuple[str, int]] = []
        for entry in files:
            if not isinstance(entry, list) or len(entry) != 2:
                raise ProtocolViolation("each file must be [name, size]")
            parsed.append((validate_file_name(entry[0]), _int(entry[1], "file size", MAX_FILE)))
        names = [n for n, _ in parsed]
        if len(set(names)) != len(names):
            raise ProtocolViolation("a file is named twice")
        save_id = body.get("save_id")
        if not isinstance(save_id, str) or not _SAVE_ID_RE.fullmatch(save_id):
            raise ProtocolViolation("save_id must match [A-Za-z0-9_-]{1,64}")
        keep = body.get("keep", [])
        if not isinstance(keep, list) or len(keep) > 1024:
            raise ProtocolViolation("keep must be a list of at most 1024 steps")
        return Put(_ns(body.get("ns")), validate_node_id(body.get("origin")), _step(body.get("step")),
                   save_id, tuple(parsed), frozenset(_step(s) for s in keep))
    if op == "status":
        return Status()
    raise ProtocolViolation(f"unknown op {str(op)[:32]!r}")
