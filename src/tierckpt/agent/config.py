"""``AgentConfig``: the node agent's settings, a frozen value validated on construction."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from tierckpt.config import DEFAULT_MEMORY_DIR, DurableLocation
from tierckpt.errors import ConfigError

__all__ = ["AgentConfig", "AgentLimits", "default_node_id", "parse_address", "parse_budget", "read_secret",
           "user_secret"]

_NODE_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
SECRET_ENV = "TIERCKPT_AGENT_SECRET"


def parse_address(text: str) -> tuple[str, int]:
    """``'host:port'`` → (host, port); ConfigError naming the fix."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"address {text!r} must be HOST:PORT, e.g. 127.0.0.1:7601")
    return host.strip("[]"), int(port)


def parse_budget(text: str, total_bytes: int) -> int:
    """``'40%'`` of ``total_bytes`` (20-100 %), or a byte count (suffixes K, M, G, T)."""
    t = text.strip()
    if t.endswith("%"):
        try:
            pct = float(t[:-1])
        except ValueError:
            raise ConfigError(f"memory budget {text!r}: use a percentage such as 40% or bytes such as 64G") from None
        if not 20 <= pct <= 100:
            raise ConfigError(f"memory budget {text!r}: a percentage must be 20-100 % of node RAM")
        return int(total_bytes * pct / 100)
    m = re.fullmatch(r"([0-9]+)([KMGT]i?B?)?", t, re.IGNORECASE)
    if not m:
        raise ConfigError(f"memory budget {text!r}: use a percentage such as 40% or bytes such as 64G")
    unit = (m.group(2) or "").upper()[:1]
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]


def node_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_node_id(memory_dir: str) -> str:
    """Stable per (host, memory root): ``<host>-<8 hex digits of the root's real path>``."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:100] or "node"
    digest = hashlib.sha256(os.path.realpath(memory_dir).encode()).hexdigest()[:8]
    return f"{host}-{digest}"


def read_secret(secret_file: str | None, environ: dict[str, str] | None = None) -> bytes | None:
    """The job secret from ``secret_file`` (first line), else $TIERCKPT_AGENT_SECRET, else None."""
    if secret_file:
        try:
            raw = Path(secret_file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"secret file {secret_file!r} cannot be read: {exc.strerror}") from None
        if not raw:
            raise ConfigError(f"secret file {secret_file!r} is empty")
        return raw
    env = os.environ if environ is None else environ
    value = env.get(SECRET_ENV, "")
    return value.encode() if value else None


USER_SECRET = "~/.config/tierckpt/agent-secret"


def user_secret(path: str = USER_SECRET) -> bytes:
    """This user's secret for agents on loopback that were given none: 32 random bytes (hex) in a
    0600 file in a 0700 directory, made on first use. Other local users cannot read it, so they
    cannot talk to these agents; this user's agents (every node of a job on one host) share it.
    A file that others could read, or that another user owns, is refused."""
    import secrets

    full = os.path.expanduser(path)
    try:
        os.makedirs(os.path.dirname(full), mode=0o700, exist_ok=True)
        try:
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"no job secret given and this user's agent secret {full} cannot be used: {exc.strerror}; "
                          f"set {SECRET_ENV} or pass --secret-file") from None
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"{full} must belong to this user with mode 0600 (it is {oct(st.st_mode & 0o777)}, "
                          f"uid {st.st_uid}); fix it or set {SECRET_ENV}")
    if len(raw) < 32:  # a concurrent first use may still be writing it
        raise ConfigError(f"{full} holds no secret (empty or truncated): remove it, or set {SECRET_ENV}")
    return raw


def _loopback(host: str) -> bool:
    """A literal loopback address, or ``localhost``; never a name that merely starts with "127."."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, kw_only=True)
class AgentLimits:
    """What one peer may hold of the agent, and for how long (defaults suit a cluster; tests shrink them).

    max_connections     peer connections at once, handshakes included; more are closed on accept
    max_per_address     of those, from one source address (a node fetching 8 ranks x 4 parts is 32)
    handshake_s         the whole handshake, from accept to the proof
    request_s           receiving one request frame, and answering any request without bulk bytes
    idle_s              waiting for the next request on an open connection
    min_rate_bps        bulk bytes (a put's files, a get's reply) must move at least this fast:
                        their deadline is ``request_s + bytes / min_rate_bps``; it bounds a pin too
    peer_deadline_s     asking one peer for its ids or its listing (peers are asked at once)
    local_idle_s        a local client that connects and says nothing is closed after this
    free_space_margin   with no budget, the fraction of the memory filesystem left free
    """

    max_connections: int = 256
    max_per_address: int = 64
    handshake_s: float = 10.0
    request_s: float = 30.0
    idle_s: float = 120.0
    min_rate_bps: float = 10e6
    peer_deadline_s: float = 10.0
    local_idle_s: float = 30.0
    free_space_margin: float = 0.05

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_per_address"):
            if getattr(self, name) < 1:
                raise ConfigError(f"limits.{name} must be at least 1")
        for name in ("handshake_s", "request_s", "idle_s", "min_rate_bps", "peer_deadline_s", "local_idle_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"limits.{name} must be > 0")
        if not 0 <= self.free_space_margin < 1:
            raise ConfigError("limits.free_space_margin must be in [0, 1)")

    def bulk_s(self, nbytes: int) -> float:
        """The deadline of a request that moves ``nbytes`` bulk bytes."""
        return self.request_s + nbytes / self.min_rate_bps


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Everything one node agent needs.

    memory_dir     the node's memory tier root (shared by every namespace on the node)
    listen         (host, port) for peers; port 0 picks a free one (see ``AgentHandle.address``)
    peers          other agents' (host, port); the ring is built over the node ids they report
    node_id        this node's stable identity (default: host + memory root)
    replicas       how many other nodes receive a copy of this node's newest step (0 = none)
    secret         the job secret; None → only a loopback ``listen`` is allowed, and the agent uses
                   this user's own secret file (``user_secret``: other local users cannot read it)
    insecure_wire  peers talk without TLS: no encryption, no integrity beyond the item checksums
                   (the handshake's MACs still authenticate each peer). Only for a fabric whose
                   every host and switch the user trusts; every agent of the job must agree.
    budget_bytes   node-wide cap on the memory tier (every namespace, replicas included); None = none
    durable_url    where the agent drains steps on ``flush`` (None: flush is a no-op)
    scan_interval_s  how often the agent rescans the memory root (notifications make it sooner)
    metrics_port   serve Prometheus metrics on 127.0.0.1:<port> (None: off; 0 picks one)
    fetch_streams  connections a load's fetch of one large file uses at once (parts of at least
                   ``fetch_part_bytes``, cut at item boundaries, each checked by its own stream)
    limits         connection caps and deadlines (``AgentLimits``)
    """

    memory_dir: str = DEFAULT_MEMORY_DIR
    listen: tuple[str, int] = ("127.0.0.1", 0)
    peers: tuple[tuple[str, int], ...] = ()
    node_id: str = ""
    replicas: int = 1
    secret: bytes | None = field(default=None, repr=False)
    insecure_wire: bool = False
    budget_bytes: int | None = None
    durable_url: str | None = None
    scan_interval_s: float = 1.0
    metrics_port: int | None = None
    fetch_streams: int = 4
    fetch_part_bytes: int = 64 << 20
    limits: AgentLimits = field(default_factory=AgentLimits)

    def __post_init__(self) -> None:
        if not os.path.isabs(self.memory_dir):
            raise ConfigError(f"memory_dir must be an absolute path, got {self.memory_dir!r}")
        if not self.node_id:
            object.__setattr__(self, "node_id", default_node_id(self.memory_dir))
        if not _NODE_RE.fullmatch(self.node_id):
            raise ConfigError(f"node id {self.node_id!r} may contain only letters, digits, '-' and '_' (1-128)")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 0:
            raise ConfigError(f"replicas must be a whole number >= 0, got {self.replicas!r}")
        if not self.secret and not _loopback(self.listen[0]):  # an empty secret is no secret
            raise ConfigError(
                f"listening on {self.listen[0]} needs a job secret: set {SECRET_ENV} or pass --secret-file "
                "(without one the agent listens on loopback only)"
            )
        if not isinstance(self.insecure_wire, bool):
            raise ConfigError(f"insecure_wire must be True or False, got {self.insecure_wire!r}")
        if self.budget_bytes is not None and self.budget_bytes < 1:
            raise ConfigError("budget_bytes must be at least 1")
        if self.durable_url is not None:
            DurableLocation.parse(self.durable_url)
        if isinstance(self.fetch_streams, bool) or not isinstance(self.fetch_streams, int) or self.fetch_streams < 1:
            raise ConfigError(f"fetch_streams must be a whole number >= 1, got {self.fetch_streams!r}")
        if self.fetch_part_bytes < 1:
            raise ConfigError("fetch_part_bytes must be at least 1")
        if self.scan_interval_s <= 0:
            raise ConfigError("scan_interval_s must be > 0")
