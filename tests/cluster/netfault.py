"""A bad link on a host's egress: delay, loss and a bandwidth cap, with ``tc netem`` or without it.

    fault = LinkFault(host)                   # host: a hosts.Host
    fault.apply(delay_ms=20, loss_pct=1, rate_mbit=100, netem=False)   # -> "nfqueue-delay+iptables-loss+tbf"
    fault.clear()                             # qdisc, rules and delayer gone (idempotent)

``Host.shape``/``Host.unshape`` call this; use those. Two mechanisms:

* ``netem`` (when the kernel has ``sch_netem``): on the host's ``eth0``, ``tc qdisc ... netem
  delay D loss L`` with a ``tbf`` child for the cap. Exact and cheap.
* the fallback, for kernels without netem but with iptables (legacy x_tables), ``br_netfilter``
  and nfnetlink_queue. The cap stays a ``tbf`` root qdisc on the host's ``eth0``; delay and loss
  act where the host's frames enter the bridge (its port ``v<i>``, in the bridge's namespace,
  with ``bridge-nf-call-iptables`` on there): ``FORWARD -m physdev --physdev-in v<i> -j
  TCKFAULT-v<i>``, a chain holding

  - loss: ``-m statistic --mode random --probability p -j DROP``;
  - delay: ``-j NFQUEUE --queue-num <i+1> --queue-bypass``, with ``nfqdelay.py`` bound to that
    queue in the bridge's namespace: it accepts each packet ``delay_ms`` after it read it.
    Userspace verdicts: some CPU per packet, and the delay is a floor, late by the scheduler's
    latency on a loaded box. Fail-open: a full queue, or no program bound (``--queue-bypass``),
    lets packets through undelayed, never drops them.

  Why there and not in the host's ``OUTPUT`` chain: a packet held in the sender's own stack
  still counts against its TCP socket's small-queue budget (about 1 ms of data), which cut a
  20 ms-delayed 100 Mbit/s link to 2 Mbit/s; past the veth the packet is the wire's (netem
  orphans it for the same reason). And ``-j DROP`` in ``OUTPUT`` is not loss: the sender's
  ``sendmsg`` fails with ``EPERM``. Unlike netem, neither sees ARP.

The delayer is the harness's child (not in the host's PID namespace: it serves the bridge): it
stops when ``clear`` closes its stdin or when the harness is gone (the pipe's end), and
``Host.kill`` clears the host's faults.
"""

from __future__ import annotations

import json
import logging
import select
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Protocol

NFQDELAY = Path(__file__).with_name("nfqdelay.py")
BRIDGE_NF = "/proc/sys/net/bridge/bridge-nf-call-iptables"
TBF = ("burst", "32kbit", "latency", "400ms")

log = logging.getLogger(__name__)


class _Host(Protocol):  # the part of hosts.Host this module uses
    name: str
    index: int
    netns: str
    bridge_port: str
    pids_started: list[int]

    @property
    def cluster(self) -> Any: ...  # .bridge_ns, .namespaces, .workdir


def fallback_missing(bridge_ns: str) -> str | None:
    """Why the iptables/NFQUEUE fallback cannot work here (None: it can), probed in ``bridge_ns``."""
    if shutil.which("iptables-legacy") is None:
        return "'iptables-legacy' is not installed (apt-get install iptables)"
    if not Path("/proc/net/netfilter/nfnetlink_queue").exists():
        return "the kernel has no nfnetlink_queue (CONFIG_NETFILTER_NETLINK_QUEUE)"
    if not Path(BRIDGE_NF).exists():
        return "the kernel has no br_netfilter (bridged frames never reach iptables)"
    probe = "TCKPROBE"
    try:
        _iptables(bridge_ns, "-N", probe)
        _iptables(bridge_ns, "-A", probe, "-m", "physdev", "--physdev-in", "v0", "-m", "statistic", "--mode",
                  "random", "--probability", "0.5", "-j", "NFQUEUE", "--queue-num", "1", "--queue-bypass")
    except RuntimeError as e:
        return f"iptables cannot queue bridged packets here: {e}"
    finally:
        _iptables(bridge_ns, "-F", probe, check=False)
        _iptables(bridge_ns, "-X", probe, check=False)
    return None


class LinkFault:
    """The faults on one host's egress. Call order: ``LinkFault(host)`` → ``apply(...)`` once →
    ``clear()`` (idempotent; also after the host was killed). ``mechanism`` says what carries
    them; ``delayer_counts`` holds the delayer's counts after ``clear``."""

    def __init__(self, host: _Host) -> None:
        self.host = host
        self.bridge_ns: str = host.cluster.bridge_ns
        self.chain = f"TCKFAULT-{host.bridge_port}"
        self.queue = host.index + 1  # queues are per network namespace: one per host port
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
        ns, chain, parts = self.bridge_ns, self.chain, []
        _run(["nsenter", f"--net=/run/netns/{ns}", "sh", "-c", f"echo 1 > {BRIDGE_NF}"])
        _iptables(ns, "-N", chain)
        self.rules = True
        if loss_pct:
            _iptables(ns, "-A", chain, "-m", "statistic", "--mode", "random", "--probability",
                      f"{loss_pct / 100:.6f}", "-j", "DROP")
            parts.append("iptables-loss")
        if delay_ms:
            self._start_delayer(delay_ms)
            _iptables(ns, "-A", chain, "-j", "NFQUEUE", "--queue-num", str(self.queue), "--queue-bypass")
            parts.insert(0, "nfqueue-delay")
        # last: the chain is complete when frames reach it
        _iptables(ns, "-A", "FORWARD", "-m", "physdev", "--physdev-in", self.host.bridge_port, "-j", chain)
        return parts

    def _start_delayer(self, delay_ms: float) -> None:
        logfile = self.host.cluster.workdir / f"nfqdelay-{self.host.name}.log"
        cmd = ["nsenter", f"--net=/run/netns/{self.bridge_ns}", sys.executable, "-I", str(NFQDELAY),
               str(self.queue), str(delay_ms)]
        with open(logfile, "ab") as err:
            # stdin: a pipe only this process holds; its end (clear(), or this process gone) stops the delayer
            self.delayer = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        self.host.pids_started.append(self.delayer.pid)  # Cluster.leftovers() looks there
        out = self.delayer.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], 60)
        line = out.readline() if ready else b""
        if line.strip() != b"ready":
            self._stop_delayer()
            raise RuntimeError(f"nfqdelay for {self.host.name} did not bind queue {self.queue}: {line!r} "
                               f"{logfile.read_text(errors='replace')[-2000:]}")

    def clear(self) -> None:
        subprocess.run(["tc", "-n", self.host.netns, "qdisc", "del", "dev", "eth0", "root"], capture_output=True,
                       timeout=30)
        if self.rules and self.bridge_ns in self.host.cluster.namespaces:
            _iptables(self.bridge_ns, "-D", "FORWARD", "-m", "physdev", "--physdev-in", self.host.bridge_port,
                      "-j", self.chain, check=False)
            _iptables(self.bridge_ns, "-F", self.chain, check=False)
            _iptables(self.bridge_ns, "-X", self.chain, check=False)
        self.rules = False
        self._stop_delayer()  # after the rules: nothing new is queued, and it accepts what it holds
        self.mechanism = ""

    def _stop_delayer(self) -> None:
        proc, self.delayer = self.delayer, None
        if proc is None:
            return
        if proc.stdin is not None and proc.stdin.closed:
            proc.stdin = None  # already closed (the delayer told to stop); communicate() would flush it
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
