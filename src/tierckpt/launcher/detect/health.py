"""Node health checks: what this machine's NICs, memory, memory tier, GPUs and the user's own
command say, each round, as ``CheckResult`` values (ok, warn or unhealthy). No thread, no verdict
over time: ``healthwatch.HealthWatch`` runs them every ``--health-interval`` and judges.

    cfg = HealthConfig(nics=("eth0",), memory_dir="/dev/shm/tierckpt", commands=("/opt/check.sh",))
    checks = build_checks(cfg)            # once, at the command line's edge: a bad command is a ConfigError
    each round: results = [r for c in checks for r in c.run()]

The built-in checks, each cheap (a few sysfs reads, one statvfs and a 1-byte probe file; ``gpu``
one ``nvidia-smi`` query), and judged so that a healthy machine never fails them:

    nic     each named interface (default: the one gloo or the rendezvous uses): present, carrier
            up; its ``carrier_changes`` and rx/tx error counters judged by their *increase* since
            the last round (a link that flapped; ``nic_errors`` or more errors in one round),
            never by their absolute value (a NIC that counted errors last month is not sick now)
    edac    the kernel's memory controllers (``/sys/devices/system/edac/mc/mc*``), where present:
            a new uncorrectable error is unhealthy, new correctable ones a warning
    memfs   the memory tier's filesystem: not mounted read-only, at least ``memfs_min_free_bytes``
            free, and a probe file can be created, written and removed
    gpu     ``nvidia-smi --query-gpu``: it answers in time, no GPU fell off the bus, no new
            uncorrectable ECC error, no page retirement or row remapping pending, no row remapping
            failed (on by default where ``nvidia-smi`` is on PATH)
    command each ``--health-check CMD`` (``/bin/sh -c``): exit 0 is healthy, anything else (or no
            answer within ``command_timeout_s``) is unhealthy, its last output line the detail

``sysfs`` and ``nvidia_smi`` are settable so that tests can point the checks at a fake tree or a
fake ``nvidia-smi`` for what cannot exist on the test machine (EDAC counters, a GPU).
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tierckpt.errors import ConfigError

__all__ = ["BUILTIN", "OK", "UNHEALTHY", "WARN", "Check", "CheckResult", "HealthConfig", "build_checks",
           "route_interface"]

OK, WARN, UNHEALTHY = "ok", "warn", "unhealthy"
BUILTIN = ("nic", "edac", "memfs", "gpu")
#: shell words that ``--health-check`` may start with although no file on PATH has their name
_SHELL_WORDS = frozenset({"!", "[", "test", "true", "false", ":", "command", "exit", "if", "for", "while", "case",
                          "{", "(", "exec", "set", "cd", "echo", "printf", "read", "eval", "type"})


@dataclass(frozen=True, kw_only=True)
class HealthConfig:
    """The node health monitor's settings (``tierckpt run`` options; see the module doc).

    enabled               ``--no-health`` turns every check off (commands too)
    checks                the built-in checks (``--health-checks nic,edac,memfs,gpu``); None: each
                          one where it applies (nic with an interface, memfs with a memory dir,
                          edac where the kernel has it, gpu where ``nvidia-smi`` is on PATH)
    commands              ``--health-check CMD``, each a shell command; non-zero exit: unhealthy
    interval_s            seconds between rounds (``--health-interval``)
    fail_after            rounds in a row a check must fail before the node counts as unhealthy
                          (``--health-fail-after``): one flap or one slow command is not a bad node
    drain_wait_s          how long an unhealthy node with a spare waiting waits for the next step
                          boundary (a step committed, and replicated where a node agent replicates)
                          before it leaves anyway (``--health-drain-wait``)
    nics                  interfaces of the nic check (``--health-nic``; the command line fills in
                          ``GLOO_SOCKET_IFNAME``'s, else the route to the rendezvous host)
    nic_errors            rx+tx errors in one round that fail it (fewer: a warning)
    memory_dir            the memory tier's root (the memfs check)
    memfs_min_free_bytes  less free space than this fails the memfs check
    command_timeout_s     a command (or ``nvidia-smi``) that has not answered by then fails
    sysfs, nvidia_smi     where the checks look (tests point them at fakes)
    """

    enabled: bool = True
    checks: tuple[str, ...] | None = None
    commands: tuple[str, ...] = ()
    interval_s: float = 10.0
    fail_after: int = 2
    drain_wait_s: float = 120.0
    nics: tuple[str, ...] = ()
    nic_errors: int = 10
    memory_dir: str | None = None
    memfs_min_free_bytes: int = 1 << 20
    command_timeout_s: float = 30.0
    sysfs: str = "/sys"
    nvidia_smi: str = "nvidia-smi"

    def __post_init__(self) -> None:
        for name, flag in (("interval_s", "--health-interval"), ("drain_wait_s", "--health-drain-wait"),
                           ("command_timeout_s", "the health command timeout")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{flag} must be more than 0 seconds, got {v!r}")
        for name, flag, low in (("fail_after", "--health-fail-after", 1), ("nic_errors", "the nic error limit", 1),
                                ("memfs_min_free_bytes", "the memfs free-space limit", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"{flag} must be a whole number >= {low}, got {v!r}")
        unknown = [c for c in self.checks or () if c not in BUILTIN]
        if unknown:
            raise ConfigError(f"--health-checks: unknown check(s) {', '.join(map(repr, unknown))}; "
                              f"choose from {', '.join(BUILTIN)} (or 'none')")
        for cmd in self.commands:
            if not isinstance(cmd, str) or not cmd.strip():
                raise ConfigError("--health-check needs a command (a shell command line), got an empty one")
        for nic in self.nics:
            if not nic or "/" in nic or nic in (".", ".."):
                raise ConfigError(f"--health-nic must name a network interface (as in /sys/class/net), got {nic!r}")


@dataclass(frozen=True)
class CheckResult:
    """One check's finding on one subject (an interface, a memory controller, a GPU, a command)."""

    check: str  # nic, edac, memfs, gpu, command
    subject: str
    status: str  # OK, WARN or UNHEALTHY
    detail: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.check, self.subject)


class Check:
    """One kind of check; ``run()`` each round (it may keep the last round's counters)."""

    name = ""

    def run(self) -> list[CheckResult]:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # absent, or EINVAL: an interface that is administratively down has no carrier file
        return None


def _int(path: Path) -> int | None:
    raw = _read(path)
    try:
        return None if raw is None else int(raw)
    except ValueError:
        return None


class NicCheck(Check):
    name = "nic"
    _ERRORS = ("rx_errors", "tx_errors")

    def __init__(self, nics: Sequence[str], *, sysfs: str, error_limit: int) -> None:
        self.nics = tuple(nics)
        self.root = Path(sysfs) / "class" / "net"
        self.error_limit = error_limit
        self._last: dict[str, tuple[int, int]] = {}  # nic -> (carrier_changes, rx+tx errors) last round

    def describe(self) -> str:
        return f"nic({','.join(self.nics)})"

    def run(self) -> list[CheckResult]:
        return [self._one(nic) for nic in self.nics]

    def _one(self, nic: str) -> CheckResult:
        base = self.root / nic
        if not base.is_dir():
            self._last.pop(nic, None)
            return CheckResult("nic", nic, UNHEALTHY, f"{nic}: no such interface (it was removed or renamed)")
        oper, carrier = _read(base / "operstate"), _int(base / "carrier")
        changes = _int(base / "carrier_changes") or 0
        errors = sum(_int(base / "statistics" / e) or 0 for e in self._ERRORS)
        before = self._last.get(nic)
        self._last[nic] = (changes, errors)
        if oper in ("down", "lowerlayerdown", "notpresent") or carrier == 0 or (carrier is None and oper != "unknown"):
            return CheckResult("nic", nic, UNHEALTHY, f"{nic}: carrier down (operstate {oper}, carrier {carrier})")
        if before is None:
            return CheckResult("nic", nic, OK, f"{nic}: up")
        flaps, new_errors = max(0, changes - before[0]), max(0, errors - before[1])
        if flaps:
            return CheckResult("nic", nic, UNHEALTHY, f"{nic}: link flapped ({flaps} carrier changes since the "
                               "last round)")
        if new_errors >= self.error_limit:
            return CheckResult("nic", nic, UNHEALTHY, f"{nic}: {new_errors} rx/tx errors since the last round "
                               f"(limit {self.error_limit})")
        if new_errors:
            return CheckResult("nic", nic, WARN, f"{nic}: {new_errors} rx/tx errors since the last round")
        return CheckResult("nic", nic, OK, f"{nic}: up")


class EdacCheck(Check):
    name = "edac"

    def __init__(self, *, sysfs: str) -> None:
        self.root = Path(sysfs) / "devices" / "system" / "edac" / "mc"
        self._last: dict[str, tuple[int, int]] = {}  # controller -> (uncorrectable, correctable)

    @staticmethod
    def present(sysfs: str) -> bool:
        return any((Path(sysfs) / "devices" / "system" / "edac" / "mc").glob("mc*"))

    def run(self) -> list[CheckResult]:
        out = []
        for mc in sorted(self.root.glob("mc*")):
            ue = sum(_int(mc / f) or 0 for f in ("ue_count", "ue_noinfo_count"))
            ce = sum(_int(mc / f) or 0 for f in ("ce_count", "ce_noinfo_count"))
            before = self._last.get(mc.name)
            self._last[mc.name] = (ue, ce)
            if before is not None and ue > before[0]:
                out.append(CheckResult("edac", mc.name, UNHEALTHY,
                                       f"{mc.name}: {ue - before[0]} new uncorrectable memory error(s) ({ue} in all)"))
            elif before is not None and ce > before[1]:
                out.append(CheckResult("edac", mc.name, WARN,
                                       f"{mc.name}: {ce - before[1]} new correctable memory error(s) ({ce} in all)"))
            else:
                out.append(CheckResult("edac", mc.name, OK, f"{mc.name}: {ue} uncorrectable, {ce} correctable"))
        return out


class MemfsCheck(Check):
    name = "memfs"

    def __init__(self, memory_dir: str, *, min_free: int) -> None:
        self.path = Path(memory_dir)
        self.min_free = min_free

    def describe(self) -> str:
        return f"memfs({self.path})"

    def run(self) -> list[CheckResult]:
        where = self.path
        while not where.exists() and where != where.parent:  # the library creates it at the first save
            where = where.parent
        try:
            st = os.statvfs(where)
        except OSError as exc:
            return [CheckResult("memfs", str(self.path), UNHEALTHY, f"{where}: statvfs failed: {exc.strerror}")]
        free = st.f_bavail * st.f_frsize
        if st.f_flag & os.ST_RDONLY:
            return [CheckResult("memfs", str(self.path), UNHEALTHY, f"{where}: mounted read-only")]
        if free < self.min_free:
            return [CheckResult("memfs", str(self.path), UNHEALTHY,
                                f"{where}: {free} bytes free, below {self.min_free} (the memory tier is full)")]
        if where == self.path:
            probe = where / f".health-{os.getpid()}-{threading.get_ident()}"
            try:
                fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.write(fd, b"x")
                finally:
                    os.close(fd)
                    probe.unlink(missing_ok=True)
            except OSError as exc:
                return [CheckResult("memfs", str(self.path), UNHEALTHY, f"{where}: cannot write: {exc.strerror}")]
        return [CheckResult("memfs", str(self.path), OK, f"{where}: writable, {free} bytes free")]


def _run(argv: Sequence[str], timeout_s: float) -> tuple[int | None, str]:
    """(exit code, output) of ``argv``; (None, output so far) when it did not answer in time (its
    whole process group is killed: a shell's children too)."""
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        return 127, f"{argv[0]}: {exc.strerror}"
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out.decode(errors="replace")
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        return None, out.decode(errors="replace")


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


class CommandCheck(Check):
    name = "command"

    def __init__(self, command: str, *, timeout_s: float) -> None:
        self.command = command
        self.timeout_s = timeout_s

    def describe(self) -> str:
        return f"command({self.command})"

    def run(self) -> list[CheckResult]:
        t0 = time.monotonic()
        code, out = _run(["/bin/sh", "-c", self.command], self.timeout_s)
        line = _last_line(out)
        if code is None:
            return [CheckResult("command", self.command, UNHEALTHY,
                                f"no answer within {self.timeout_s:g}s (killed){': ' + line if line else ''}")]
        if code != 0:
            what = "not found" if code == 127 else f"exit {code}" if code > 0 else f"killed by signal {-code}"
            return [CheckResult("command", self.command, UNHEALTHY, f"{what}{': ' + line if line else ''}")]
        return [CheckResult("command", self.command, OK, f"exit 0 in {time.monotonic() - t0:.2f}s")]


class GpuCheck(Check):
    name = "gpu"
    #: row remapping (Ampere and later) replaced page retirement; a driver or GPU without it answers
    #: "is not a valid field to query" and the check goes on with ``BASE`` alone
    BASE = "index,uuid,ecc.errors.uncorrected.volatile.total,retired_pages.pending"
    QUERY = BASE + ",remapped_rows.pending,remapped_rows.failure"

    def __init__(self, nvidia_smi: str, *, timeout_s: float) -> None:
        self.nvidia_smi = nvidia_smi
        self.timeout_s = timeout_s
        self.query = self.QUERY
        self._seen: dict[str, int] = {}  # uuid -> uncorrectable ECC errors last round (the GPUs seen)

    def _query(self) -> tuple[int | None, str]:
        code, out = _run([self.nvidia_smi, f"--query-gpu={self.query}", "--format=csv,noheader,nounits"],
                         self.timeout_s)
        if code not in (0, None) and "not a valid field" in out and self.query != self.BASE:
            self.query = self.BASE
            return self._query()
        return code, out

    def run(self) -> list[CheckResult]:
        code, out = self._query()
        if code != 0:
            what = f"no answer within {self.timeout_s:g}s" if code is None else f"exit {code}"
            return [CheckResult("gpu", "nvidia-smi", UNHEALTHY, f"nvidia-smi: {what}: {_last_line(out)}")]
        found: dict[str, list[str]] = {}
        for line in out.splitlines():
            cols = [c.strip() for c in line.split(",")]
            if len(cols) >= 4:
                found[cols[1]] = cols
        results = []
        for uuid in sorted(set(self._seen) - set(found)):
            results.append(CheckResult("gpu", uuid, UNHEALTHY, f"{uuid}: gone (no longer listed by nvidia-smi)"))
        for uuid, (index, _, ecc, pending, *remap) in found.items():
            subject = f"gpu{index}"
            remap_pending, remap_failed = (remap + ["", ""])[:2]
            bad = next((c for c in (ecc, pending, *remap) if "ERR" in c or "requires reset" in c.lower()), None)
            errors = int(ecc) if ecc.isdigit() else None
            before = self._seen.get(uuid)
            self._seen[uuid] = errors if errors is not None else (before or 0)
            if bad is not None:
                results.append(CheckResult("gpu", subject, UNHEALTHY, f"{subject} ({uuid}): nvidia-smi reads {bad!r}"))
            elif errors is not None and before is not None and errors > before:
                results.append(CheckResult("gpu", subject, UNHEALTHY,
                                           f"{subject}: {errors - before} new uncorrectable ECC error(s)"))
            elif pending.lower() == "yes" or remap_pending.lower() == "yes":
                what = "a page retirement" if pending.lower() == "yes" else "a row remapping"
                results.append(CheckResult("gpu", subject, UNHEALTHY, f"{subject}: {what} is pending (the GPU needs "
                                           "a reset)"))
            elif remap_failed.lower() == "yes":
                results.append(CheckResult("gpu", subject, UNHEALTHY, f"{subject}: a row remapping failed (replace "
                                           "the GPU)"))
            else:
                results.append(CheckResult("gpu", subject, OK, f"{subject}: ok"))
        return results


def validate_command(cmd: str) -> None:
    """A ``--health-check`` command must parse as a shell line and start with a command that exists."""
    try:
        words = shlex.split(cmd)
    except ValueError as exc:
        raise ConfigError(f"--health-check {cmd!r} does not parse as a shell command: {exc}") from None
    first = words[0] if words else ""
    if "=" in first and not first.startswith("/"):  # VAR=value cmd ...
        first = next((w for w in words if "=" not in w), "")
    if not first or first in _SHELL_WORDS:
        return
    found = (os.access(first, os.X_OK) and os.path.isfile(first)) if "/" in first else shutil.which(first) is not None
    if not found:
        raise ConfigError(f"--health-check {cmd!r}: {first!r} is not an executable file"
                          + ("" if "/" in first else " on PATH") + "; give a command that exists on every node")


def build_checks(cfg: HealthConfig) -> list[Check]:
    """The checks ``cfg`` asks for, in a fixed order; a command that cannot run, or ``gpu`` asked for
    without ``nvidia-smi``, is a ConfigError (reported before any worker starts)."""
    if not cfg.enabled:
        return []
    auto = cfg.checks is None
    wanted = set(BUILTIN if auto else cfg.checks or ())
    out: list[Check] = []
    if "nic" in wanted and cfg.nics:
        out.append(NicCheck(cfg.nics, sysfs=cfg.sysfs, error_limit=cfg.nic_errors))
    elif "nic" in wanted and not auto:
        raise ConfigError("--health-checks nic: no interface to watch; name one with --health-nic")
    if "edac" in wanted and (not auto or EdacCheck.present(cfg.sysfs)):
        out.append(EdacCheck(sysfs=cfg.sysfs))
    if "memfs" in wanted and cfg.memory_dir:
        out.append(MemfsCheck(cfg.memory_dir, min_free=cfg.memfs_min_free_bytes))
    if "gpu" in wanted:
        if shutil.which(cfg.nvidia_smi) is not None:
            out.append(GpuCheck(cfg.nvidia_smi, timeout_s=cfg.command_timeout_s))
        elif not auto:
            raise ConfigError(f"--health-checks gpu: {cfg.nvidia_smi!r} is not on PATH; leave gpu out on "
                              "machines without NVIDIA GPUs")
    for cmd in cfg.commands:
        validate_command(cmd)
        out.append(CommandCheck(cmd, timeout_s=cfg.command_timeout_s))
    return out


def route_interface(host: str, *, sysfs: str = "/sys") -> str | None:
    """The local interface whose address this machine uses to reach ``host`` (the rendezvous
    endpoint's), or None when that cannot be told (no route, no IPv4, no matching interface)."""
    try:
        addr = socket.getaddrinfo(host, 1, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 1))  # UDP: no packet is sent; the kernel picks the source address
            local = s.getsockname()[0]
    except OSError:
        return None
    import fcntl
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        if socket.inet_ntoa(raw[20:24]) == local and (Path(sysfs) / "class" / "net" / name).exists():
            return name
    return None

