"""The agent's peer protocol, sans I/O: framing, the handshake's MACs, request validation.

A connection between two agents (TCP) starts with one plaintext frame; then, unless both run
with the insecure wire, TLS 1.3 (``agent.tls``) carries everything else:

    frame   = MAGIC (4 bytes, b"TCK2") + body length (uint32, big-endian) + body (JSON object)
    server → hello   {op, node, nonce, wire}   (plaintext; wire is "tls13" or "insecure": a client
                                                 whose own wire differs refuses, so nobody on the
                                                 path can strip TLS)
    [TLS 1.3 handshake: the client accepts the agent's ephemeral self-signed certificate]
    client → auth    {op, node, nonce}
    server → welcome {op, node, mac}    mac = HMAC(secret, "s" | transcript)
    client → proof   {op, mac}          mac = HMAC(secret, "c" | transcript), sent only after the
                                        client checked the server's MAC
    transcript = both nonces, both node ids, the wire, and the SHA-256 of the server's TLS
    certificate as the client saw it (RFC 5929 tls-server-end-point): a relay that terminates
    TLS shows its own certificate, so the MACs differ and neither side goes on.
    bulk bytes go in segments of at most ``SEGMENT`` bytes, each preceded by one byte (``wire``).
    requests, one at a time:
      list {ns}         → listing {steps: [...], more} ...  (several frames until more is false;
                          an entry's ``held``/``all`` may be split across frames: merge by key)
      get  {ns, origin, step, name, [offset, length]} → file {size} + the bytes | error
      put  {ns, origin, step, save_id, files: [[name, size], ...], keep: [steps], owner}
                        → ready {} | held {} | error; after ready: the files' bytes in order
                        → stored {} | error {message}
      status {}         → status {...}

An agent without a job secret listens on loopback only and uses this user's own secret
(``config.user_secret``), so the empty key never authenticates anyone.

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
from tierckpt.errors import ConfigError, TierckptError

__all__ = [
    "HEADER",
    "MAGIC",
    "MAX_BODY",
    "MAX_FILE",
    "Get",
    "ListSteps",
    "ListingEntry",
    "SEGMENT",
    "WIRES",
    "ProtocolViolation",
    "Put",
    "Status",
    "channel_binding",
    "client_mac",
    "decode_body",
    "encode",
    "parse_header",
    "parse_listing_entry",
    "parse_request",
    "reply_error",
    "server_mac",
    "too_deep",
    "validate_file_name",
    "validate_node_id",
    "validate_save_id",
]

MAGIC = b"TCK2"  # 2: TLS 1.3 under the frames, segment markers instead of tags
HEADER = struct.Struct("!4sI")
MAX_BODY = 1 << 20
MAX_FILE = 1 << 40
SMALL_FILES = (layout.METADATA, layout.MANIFEST, layout.MARKER)  # a step's sealed files
MAX_SMALL = 64 << 20  # most bytes one of them may have
MAX_FILES = 4096
MAX_DEPTH = 16  # no agent message nests deeper than 4
SEGMENT = 8 << 20  # bulk bytes per segment marker
WIRES = ("tls13", "insecure")
_NODE_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
_FILE_RE = re.compile(r"__[0-9]{1,9}_[0-9]{1,9}\.distcp|\.metadata|manifest\.json|COMMITTED")
_NONCE_RE = re.compile(r"[0-9a-f]{64}")


class ProtocolViolation(TierckptError):
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
    if too_deep(raw):
        raise ProtocolViolation(f"body nests deeper than {MAX_DEPTH} levels")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolViolation(f"body is not JSON: {exc}") from None
    except RecursionError:
        raise ProtocolViolation("body nests too deeply") from None
    if not isinstance(body, dict) or not isinstance(body.get("op"), str):
        raise ProtocolViolation("body must be an object with an 'op'")
    return body


def too_deep(raw: bytes) -> bool:
    """Whether brackets nest deeper than MAX_DEPTH (a cheap upper bound: brackets inside
    strings count too, which only refuses bodies no agent sends)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return False
    depth = 0
    for byte in raw:
        if byte in (0x5B, 0x7B):
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return False


# -- handshake ---------------------------------------------------------------------
def _transcript(server_nonce: str, client_nonce: str, server_node: str, client_node: str, binding: bytes) -> bytes:
    return b"\0".join((bytes.fromhex(server_nonce), bytes.fromhex(client_nonce), server_node.encode(),
                       client_node.encode(), binding))


def channel_binding(wire: str, end_point: bytes) -> bytes:
    """What the MACs bind besides nonces and ids: the wire, and the server certificate's SHA-256."""
    return wire.encode() + b":" + end_point


def client_mac(secret: bytes, server_nonce: str, client_nonce: str, server_node: str, client_node: str,
               binding: bytes) -> str:
    """The client's proof: binds the secret, both nonces, both node ids and the channel (``channel_binding``)."""
    data = b"c" + _transcript(server_nonce, client_nonce, server_node, client_node, binding)
    return hmac.new(secret, data, hashlib.sha256).hexdigest()


def server_mac(secret: bytes, server_nonce: str, client_nonce: str, server_node: str, client_node: str,
               binding: bytes) -> str:
    """The server's proof, sent (and checked by the client) before the client's."""
    data = b"s" + _transcript(server_nonce, client_nonce, server_node, client_node, binding)
    return hmac.new(secret, data, hashlib.sha256).hexdigest()


def check_mac(expected: str, got: object) -> None:
    """ProtocolViolation unless ``got`` is the expected MAC; any other value (not a string, not
    ASCII: ``compare_digest`` raises TypeError on those) is just as wrong."""
    if not isinstance(got, str) or not got.isascii() or not hmac.compare_digest(expected, got):
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
    owner: str = ""  # the sender's owner token (hex): only its holder may replace or delete these replicas

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.files)


@dataclass(frozen=True)
class Status:
    pass


Request = ListSteps | Get | Put | Status
_SAVE_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_LIST_NAMES = 8000  # names per listing frame: well under MAX_BODY


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
        return _put(body)
    if op == "status":
        return Status()
    raise ProtocolViolation(f"unknown op {str(op)[:32]!r}")


def _put(body: Mapping[str, Any]) -> Put:
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
    keep = body.get("keep", [])
    if not isinstance(keep, list) or len(keep) > 1024:
        raise ProtocolViolation("keep must be a list of at most 1024 steps")
    owner = body.get("owner")
    if not isinstance(owner, str) or not _NONCE_RE.fullmatch(owner):
        raise ProtocolViolation("owner must be 64 lowercase hex digits (the sending agent's token)")
    return Put(_ns(body.get("ns")), validate_node_id(body.get("origin")), _step(body.get("step")),
               validate_save_id(body.get("save_id")), tuple(parsed), frozenset(_step(s) for s in keep), owner)


def validate_save_id(value: object) -> str:
    if not isinstance(value, str) or not _SAVE_ID_RE.fullmatch(value):
        raise ProtocolViolation("save_id must match [A-Za-z0-9_-]{1,64}")
    return value


@dataclass(frozen=True)
class ListingEntry:
    """One validated piece of a ``listing`` reply (a step copy's files, possibly in several pieces)."""

    step: int
    origin: str
    save_id: str
    held: dict[str, int]
    all_files: tuple[str, ...]


def parse_listing_entry(entry: object) -> ListingEntry:
    """An entry of a peer's listing, every field checked; ProtocolViolation for a bad one
    (the caller drops that entry only)."""
    if not isinstance(entry, dict):
        raise ProtocolViolation("a listing entry must be an object")
    held = entry.get("held", {})
    names = entry.get("all", [])
    if not isinstance(held, dict) or not isinstance(names, list) or len(held) + len(names) > 2 * MAX_LIST_NAMES:
        raise ProtocolViolation("a listing entry's held/all must be an object and a list of bounded size")
    return ListingEntry(_step(entry.get("step")), validate_node_id(entry.get("origin")),
                        validate_save_id(entry.get("save_id")),
                        {validate_file_name(n): _int(v, "file size", MAX_FILE) for n, v in held.items()},
                        tuple(validate_file_name(n) for n in names))


def reply_error(message: str, kind: str = "storage") -> dict[str, Any]:
    return {"ok": False, "kind": kind, "error": message}
