"""A bad link on a host's egress: delay, loss and a bandwidth cap, with ``tc netem`` or without it.

    fault = LinkFault(host)                   # host: a hosts.Host (netns, popen, cluster.workdir)
    fault.apply(delay_ms=20, loss_pct=1, rate_mbit=100, netem=False)   # -> "nfqueue-delay+iptables-loss+tbf"
    fault.clear()                             # qdisc, rules and delayer gone (idempotent)

``Host.shape``/``Host.unshape`` call this; use those. Two mechanisms, both on ``eth0``'s egress
inside the host's network namespace, so they end with it:

* ``netem`` (when the kernel has ``sch_netem``): ``tc qdisc ... netem delay D loss L``, a
  ``tbf`` child for the cap. Exact and cheap.
* the fallback, for kernels without netem but with iptables (legacy x_tables) and
  nfnetlink_queue. A chain ``TCKFAULT`` jumped to from ``OUTPUT -o eth0``:

  - loss: ``-m statistic --mode random --probability p -j NFQUEUE --queue-num 65535`` with no
    program bound to queue 65535 and no ``--queue-bypass``, so the kernel frees the packet and the
    sender is told nothing, as on a lossy wire. (``-j DROP`` in ``OUTPUT`` is not loss: the
    sender's ``sendmsg`` fails with ``EPERM``.)
  - delay: ``-j NFQUEUE --queue-num 1 --queue-bypass`` and ``nfqdelay.py`` bound to queue 1 in
    the host, which accepts each packet ``delay_ms`` after it read it. Userspace verdicts: some
    CPU per packet and a delay that is a floor, late by the scheduler's latency on a loaded box.
    Fail-open: a full queue, or no program bound (``--queue-bypass``), lets packets through
    undelayed, never drops them.
  - the cap: the same ``tbf`` root qdisc; the packets reach it after ``OUTPUT``, so after
    their delay.

  Unlike netem, neither sees ARP, and a delayed packet still counts against its TCP socket's
  small-queue budget (``tcp_limit_output_bytes``, 4 MiB here: not a limit at these delays).
"""

from __future__ import annotations

import json
import logging
import select
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

NFQDELAY = Path(__file__).with_name("nfqdelay.py")
CHAIN = "TCKFAULT"
DELAY_QUEUE = 1
LOSS_QUEUE = 65535  # never bound: NFQUEUE without --queue-bypass to an unbound queue is a silent drop
TBF = ("burst", "32kbit", "latency", "400ms")

log = logging.getLogger(__name__)


class _Host(Protocol):  # the part of hosts.Host this module uses
    name: str
    netns: str

    @property
    def cluster(self) -> Any: ...

    def alive(self) -> bool: ...

    def popen(self, cmd: Sequence[str], **kw: Any) -> subprocess.Popen[Any]: ...


def fallback_missing(netns: str) -> str | None:
    """Why the iptables/NFQUEUE fallback cannot work here (None: it can), probed in ``netns``."""
    if shutil.which("iptables-legacy") is None:
        return "'iptables-legacy' is not installed (apt-get install iptables)"
    if not Path("/proc/net/netfilter/nfnetlink_queue").exists():
        return "the kernel has no nfnetlink_queue (CONFIG_NETFILTER_NETLINK_QUEUE)"
    probe = "TCKPROBE"
    try:
        _iptables(netns, "-N", probe)
        _iptables(netns, "-A", probe, "-m", "statistic", "--mode", "random", "--probability", "0.5",
                  "-j", "NFQUEUE", "--queue-num", str(DELAY_QUEUE), "--queue-bypass")
    except RuntimeError as e:
        return f"iptables cannot queue packets here: {e}"
    finally:
        _iptables(netns, "-F", probe, check=False)
        _iptables(netns, "-X", probe, check=False)
    return None


class LinkFault:
    """The faults on one host's egress. Call order: ``LinkFault(host)`` → ``apply(...)`` once →
    ``clear()`` (idempotent; also after the host was killed). ``mechanism`` says what carries
    them; ``delayer_counts`` holds the delayer's counts after ``clear``."""

    def __init__(self, host: _Host) -> None:
        self.host = host
        self.mechanism = ""
        self.delayer: subprocess.Popen[bytes] | None = None
        self.delayer_counts: dict[str, int] = {}
        self.rules = False

    def apply(self, *, delay_ms: float, loss_pct: float, rate_mbit: float | None, netem: bool) -> str:
        """Shape the host's egress; returns the mechanism (e.g. ``netem+tbf``, ``nfqueue-delay+tbf``)."""
        if not 0 <= loss_pct <= 100 or delay_ms < 0:
            raise ValueError(f"delay_ms {delay_ms} must be >= 0 and loss_pct {loss_pct} within 0..100")
        tc = ["tc", "-n", self.host.netns, "qdisc", "add", "dev", "eth0"]
        tbf = ["tbf", "rate", f"{rate_mbit}mbit", *TBF]
        parts: list[str] = []
        if netem and (delay_ms or loss_pct):
            _run([*tc, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%"])
            parts.append("netem")
            if rate_mbit:
                _run([*tc, "parent", "1:1", "handle", "10:", *tbf])
        elif rate_mbit:
            _run([*tc, "root", "handle", "1:", *tbf])
        if not netem and (delay_ms or loss_pct):
            parts += self._fallback(delay_ms, loss_pct)
        if rate_mbit:
            parts.append("tbf")
        self.mechanism = "+".join(parts)
        log.info("host %s: delay %s ms, loss %s %%, rate %s Mbit/s via %s", self.host.name, delay_ms, loss_pct,
                 rate_mbit, self.mechanism or "nothing")
        return self.mechanism

    def _fallback(self, delay_ms: float, loss_pct: float) -> list[str]:
        ns, parts = self.host.netns, []
        _iptables(ns, "-N", CHAIN)
        self.rules = True
        if loss_pct:
            _iptables(ns, "-A", CHAIN, "-m", "statistic", "--mode", "random", "--probability",
                      f"{loss_pct / 100:.6f}", "-j", "NFQUEUE", "--queue-num", str(LOSS_QUEUE))
            parts.append("iptables-loss")
        if delay_ms:
            self._start_delayer(delay_ms)
            _iptables(ns, "-A", CHAIN, "-j", "NFQUEUE", "--queue-num", str(DELAY_QUEUE), "--queue-bypass")
            parts.insert(0, "nfqueue-delay")
        _iptables(ns, "-A", "OUTPUT", "-o", "eth0", "-j", CHAIN)  # last: the chain is complete when used
        return parts

    def _start_delayer(self, delay_ms: float) -> None:
        logfile = self.host.cluster.workdir / f"nfqdelay-{self.host.name}.log"
        with open(logfile, "ab") as err:
            # stdin: a pipe only this process holds; its end (clear(), or this process gone) stops the delayer
            self.delayer = self.host.popen([sys.executable, "-I", str(NFQDELAY), str(DELAY_QUEUE), str(delay_ms)],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        out = self.delayer.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], 60)
        line = out.readline() if ready else b""
        if line.strip() != b"ready":
            self._stop_delayer()
            raise RuntimeError(f"nfqdelay on {self.host.name} did not bind queue {DELAY_QUEUE}: {line!r} "
                               f"{logfile.read_text(errors='replace')[-2000:]}")

    def clear(self) -> None:
        ns = self.host.netns
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root"], capture_output=True, timeout=30)
        if self.rules and self.host.alive():
            _iptables(ns, "-D", "OUTPUT", "-o", "eth0", "-j", CHAIN, check=False)
            _iptables(ns, "-F", CHAIN, check=False)
            _iptables(ns, "-X", CHAIN, check=False)
        self.rules = False
        self._stop_delayer()  # after the rules: nothing new is queued, and it accepts what it holds
        self.mechanism = ""

    def _stop_delayer(self) -> None:
        proc, self.delayer = self.delayer, None
        if proc is None:
            return
        try:
            out, _ = proc.communicate(timeout=20)  # closes its stdin: the delayer's cue to stop
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate(timeout=30)
        lines = (out or b"").decode(errors="replace").strip().splitlines()
        try:
            self.delayer_counts = json.loads(lines[-1]) if lines else {}
        except ValueError:
            self.delayer_counts = {}


def _iptables(netns: str, *args: str, check: bool = True) -> None:
    _run(["nsenter", f"--net=/run/netns/{netns}", "iptables-legacy", "-w", "30", *args], check=check)


def _run(cmd: list[str], check: bool = True) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
