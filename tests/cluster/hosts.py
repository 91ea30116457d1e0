"""Hosts of their own on one box: network, UTS, mount and PID namespaces per host.

    cluster = Cluster(tmp_path)              # a bridge in a network namespace of its own
    a, b = cluster.add_host(), cluster.add_host()
    a.run(["ping", "-c1", b.ip])             # each host: own IP, hostname, /dev/shm, /proc
    proc = b.popen(["python", "-m", "x"], env=env, stdout=log)
    b.link(up=False); b.link(up=True)        # partition and heal
    b.add_nic("eth1")                        # a second NIC on a fabric of its own (storage, RDMA)
    b.nic_carrier("eth1", up=False)          # it loses carrier; eth0 carries on
    b.shape(delay_ms=20, loss_pct=1, rate_mbit=10)   # netem, or iptables + NFQUEUE (netfault.py)
    b.kill()                                 # hardware loss: every process, its tmpfs, its IP
    c = cluster.add_host()                   # the replacement: a new name and a new IP
    cluster.close()                          # every namespace, link and process made, by name/pid

Layout: one network namespace ``<prefix>-br`` holds the bridge ``br0``; each host has a
network namespace ``<prefix>-h<i>`` with ``eth0`` (``<subnet>.<i+1>/24``), the peer of
``v<i>`` on the bridge. A NIC added with ``add_nic(name)`` is the peer of ``v<i>-<name>`` on a
bridge of that name's own (``br-<name>``, made by the first host to add it: one fabric per NIC
name), with ``<fabric subnet>.<i+1>/24``; it goes with the host's namespace, its bridge with the
cluster's. Nothing is added to the machine's own network namespace: the veth pairs
are created inside the bridge's namespace with their far end moved straight into the host's.
The prefix and the /24 are drawn at random per ``Cluster``, so concurrent runs never share a
name (each run's bridge is isolated anyway).

A host's processes live under its init (``hostinit.py``, PID 1 of the host's PID namespace,
started by ``nsenter --net=/run/netns/<ns> unshare ...``: unlike ``ip netns exec``
it keeps the machine's ``/sys`` and its cgroup mounts, which ``slurmd`` wants; ``hostinit`` binds
the host's own ``/sys/class/net`` over it); ``popen``/``run`` enter the host with ``nsenter``
on that init's namespaces. PIDs a host's processes report (``os.getpid()``) are the host's own:
signal them with ``host.run(["kill", ...])``. Hosts resolve each other by name through the run's
hosts file, bind-mounted on every host's ``/etc/hosts`` and appended to when a host is added.
"""

from __future__ import annotations

import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.cluster import netfault

HOSTINIT = Path(__file__).with_name("hostinit.py")
SHM_SIZE = "512m"


def unavailable() -> str | None:
    """Why hosts cannot be made here (None: they can): root, iproute2, util-linux, namespaces."""
    if os.geteuid() != 0:
        return "namespaced hosts need root (ip netns, unshare, mount)"
    for tool in ("ip", "tc", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (apt-get install iproute2 util-linux)"
    name = f"tckprobe-{os.getpid()}-{random.randrange(1 << 24):06x}"
    try:
        _ip("netns", "add", name)
    except RuntimeError as e:
        return f"cannot create a network namespace: {e}"
    try:
        probe = subprocess.run(["ip", "netns", "exec", name, "unshare", "--uts", "--mount", "--pid", "--fork",
                                "--propagation", "private", "--mount-proc", "mount", "-t", "tmpfs", "tmpfs",
                                "/dev/shm"], capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            return f"unshare --uts --mount --pid fails here: {probe.stderr.strip()}"
    finally:
        _ip("netns", "del", name)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


class Cluster:
    """Hosts on one bridge. Call order: ``Cluster(workdir)`` → ``add_host()`` (any time, also
    after a host was killed) → per host ``popen``/``run`` and faults → ``close()`` (idempotent;
    the fixture calls it also when the test failed)."""

    def __init__(self, workdir: Path, *, shm_size: str = SHM_SIZE) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.prefix = f"tck{os.getpid() % 10000}{random.randrange(1 << 16):04x}"
        self.subnet = f"10.77.{random.randrange(256)}"
        self.bridge_ns = f"{self.prefix}-br"
        self.shm_size = shm_size
        self.hosts: list[Host] = []
        self.hosts_file = workdir / "hosts"
        self.hosts_file.write_text("127.0.0.1 localhost\n")
        self.namespaces: list[str] = []
        self.fabrics: dict[str, str] = {}  # NIC name -> the /24 of its bridge (add_nic)
        self._netem_missing: str | None = None  # "" once probed and found
        _ip("netns", "add", self.bridge_ns)
        self.namespaces.append(self.bridge_ns)
        try:
            _ip("link", "add", "br0", "type", "bridge", netns=self.bridge_ns)
            _ip("link", "set", "br0", "up", netns=self.bridge_ns)
        except RuntimeError:
            self.close()  # the caller never gets this object to close
            raise

    def add_host(self, name: str | None = None) -> Host:
        index = len(self.hosts)
        host = Host(self, index, name or f"h{index}", f"{self.subnet}.{index + 1}")
        self.hosts.append(host)
        # in place (not a new file): every host's /etc/hosts is a bind mount of this inode
        with open(self.hosts_file, "a") as f:
            f.write(f"{host.ip} {host.name}\n")
        host.start()
        return host

    def fabric(self, nic: str) -> str:
        """The /24 of the bridge that every host's ``nic`` (``Host.add_nic``) plugs into; the
        bridge ``br-<nic>`` is made on the first call."""
        if nic not in self.fabrics:
            subnet = f"10.{78 + len(self.fabrics)}.{random.randrange(256)}"  # 10.77 is eth0's
            _ip("link", "add", f"br-{nic}", "type", "bridge", netns=self.bridge_ns)
            _ip("link", "set", f"br-{nic}", "up", netns=self.bridge_ns)
            self.fabrics[nic] = subnet
        return self.fabrics[nic]

    def netem_missing(self) -> str | None:
        """Why ``tc netem`` cannot shape links here (None: it can); probed once per cluster."""
        if self._netem_missing is None:
            self._netem_missing = self._probe_netem() or ""
        return self._netem_missing or None

    def shaping_missing(self) -> str | None:
        """Why ``Host.shape(delay_ms=..., loss_pct=...)`` cannot work here (None: netem or the
        iptables/NFQUEUE fallback can)."""
        netem = self.netem_missing()
        if netem is None:
            return None
        fallback = netfault.fallback_missing(self.bridge_ns)
        return None if fallback is None else f"{netem}; and no fallback: {fallback}"

    def _probe_netem(self) -> str | None:
        probe = subprocess.run(["tc", "-n", self.bridge_ns, "qdisc", "add", "dev", "br0", "root", "netem",
                                "delay", "1ms"], capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            return f"tc netem is not available (kernel without CONFIG_NET_SCH_NETEM?): {probe.stderr.strip()}"
        subprocess.run(["tc", "-n", self.bridge_ns, "qdisc", "del", "dev", "br0", "root"], timeout=30)
        return None

    def close(self) -> None:
        for host in self.hosts:
            host.kill()
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.namespaces.clear()

    def leftovers(self) -> list[str]:
        """Namespaces of this cluster that still exist, and host processes still running."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        out = [line.split()[0] for line in listed.splitlines() if line.startswith(self.prefix)]
        for host in self.hosts:
            out += [f"pid {p}" for p in host.pids_started if _alive(p)]
        return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][:1]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


class Host:
    """One host. Made by ``Cluster.add_host``; ``kill`` is final (add a new host to replace it)."""

    def __init__(self, cluster: Cluster, index: int, name: str, ip: str) -> None:
        self.cluster = cluster
        self.index = index
        self.name = name
        self.ip = ip
        self.netns = f"{cluster.prefix}-h{index}"
        self.bridge_port = f"v{index}"
        self.ports = {"eth0": self.bridge_port}  # NIC -> its peer on a bridge (the cable's far end)
        self.unshare: subprocess.Popen[bytes] | None = None
        self.init_pid = 0
        self.procs: list[subprocess.Popen[Any]] = []
        self.pids_started: list[int] = []  # the machine's PIDs of this host's init and nsenters
        self.mnt_ns = ""
        self.fault: netfault.LinkFault | None = None

    def start(self) -> None:
        c = self.cluster
        _ip("netns", "add", self.netns)
        c.namespaces.append(self.netns)
        _ip("link", "add", self.bridge_port, "type", "veth", "peer", "name", "eth0", "netns", self.netns,
            netns=c.bridge_ns)
        _ip("link", "set", self.bridge_port, "master", "br0", netns=c.bridge_ns)
        _ip("link", "set", self.bridge_port, "up", netns=c.bridge_ns)
        _ip("addr", "add", f"{self.ip}/24", "dev", "eth0", netns=self.netns)
        _ip("link", "set", "eth0", "up", netns=self.netns)
        _ip("link", "set", "lo", "up", netns=self.netns)
        self.init_log = c.workdir / f"init-{self.name}.log"
        log = open(self.init_log, "wb")  # noqa: SIM115 - the child owns it
        self.unshare = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.netns}", "unshare", "--uts", "--mount", "--pid", "--fork",
             "--propagation", "private", "--mount-proc", sys.executable, "-I", str(HOSTINIT), self.name,
             str(c.hosts_file), c.shm_size], stdout=subprocess.PIPE, stderr=log)
        log.close()
        self.pids_started.append(self.unshare.pid)
        assert self.unshare.stdout is not None
        with self.unshare.stdout as out:
            ready, _, _ = select.select([out], [], [], 60)
            line = out.readline() if ready else b""
        if line.strip() != b"ready":
            raise RuntimeError(f"host {self.name} did not start: {line!r} {self.init_log.read_text()}")
        kids = children(self.unshare.pid)
        if len(kids) != 1:
            raise RuntimeError(f"host {self.name}: expected one init under unshare {self.unshare.pid}, got {kids}")
        self.init_pid = kids[0]
        self.pids_started.append(self.init_pid)
        self.mnt_ns = os.readlink(f"/proc/{self.init_pid}/ns/mnt")

    # ---- running things on the host ----
    def command(self, cmd: Sequence[str], cwd: str | Path | None = None) -> list[str]:
        """``cmd`` entered into this host's namespaces (network, UTS, mount, PID)."""
        wd = str(cwd or self.cluster.workdir)
        return ["nsenter", f"--target={self.init_pid}", "--net", "--uts", "--mount", "--pid", f"--wd={wd}",
                "--", *cmd]

    def popen(self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
              **kw: Any) -> subprocess.Popen[Any]:
        if not self.alive():
            raise RuntimeError(f"host {self.name} is gone")
        proc = subprocess.Popen(self.command(cmd, cwd), env=dict(env) if env is not None else None, **kw)
        self.procs.append(proc)
        self.pids_started.append(proc.pid)
        return proc

    def run(self, cmd: Sequence[str], *, timeout: float = 60, check: bool = True,
            env: Mapping[str, str] | None = None, cwd: str | Path | None = None) -> subprocess.CompletedProcess[str]:
        proc = self.popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=timeout)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check and proc.returncode != 0:
            raise RuntimeError(f"on {self.name}: {' '.join(cmd)} exited {proc.returncode}: {err.strip()}")
        return done

    def alive(self) -> bool:
        return self.init_pid != 0 and _alive(self.init_pid)

    # ---- faults ----
    def kill(self) -> None:
        """Hardware loss: the links go down (nothing more leaves the host), then SIGKILL to the
        host's init takes every process of its PID namespace; the
        mount namespace (and its /dev/shm tmpfs) goes with the last of them; the network namespace
        (its address and link) is deleted. Idempotent."""
        if self.init_pid and _alive(self.init_pid):
            # the links first: a machine that loses power sends no FIN or RST for its sockets
            if self.netns in self.cluster.namespaces:
                for nic in self.ports:
                    self.nic_carrier(nic, up=False)
            os.kill(self.init_pid, signal.SIGKILL)
        for proc in [*([self.unshare] if self.unshare else []), *self.procs]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # an nsenter whose child ignored the namespace's end
                proc.kill()
                proc.wait(timeout=30)
        if self.netns in self.cluster.namespaces:
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=30)
            self.cluster.namespaces.remove(self.netns)
        if self.fault is not None:  # its rules on the bridge and its delayer go with it
            self.fault.clear()

    def link(self, *, up: bool) -> None:
        """Partition (down) or heal (up) this host's link: its bridge port, so the host keeps its
        address and sees no carrier, as when a cable or a switch port goes."""
        self.nic_carrier("eth0", up=up)

    def add_nic(self, name: str) -> str:
        """A second NIC ``name`` (``eth1``: a storage or RDMA fabric's), up, on the bridge every
        host's ``name`` shares (``Cluster.fabric``); its address. gloo and the rendezvous stay on
        ``eth0``. Removed with the host's network namespace (``kill``, ``Cluster.close``)."""
        if name in self.ports:
            raise ValueError(f"{self.name} already has {name}")
        c = self.cluster
        port = f"v{self.index}-{name}"
        if len(port) > 15:  # IFNAMSIZ
            raise ValueError(f"NIC name {name!r} too long: its bridge port {port!r} exceeds 15 characters")
        addr = f"{c.fabric(name)}.{self.index + 1}"
        _ip("link", "add", port, "type", "veth", "peer", "name", name, "netns", self.netns, netns=c.bridge_ns)
        self.ports[name] = port
        _ip("link", "set", port, "master", f"br-{name}", netns=c.bridge_ns)
        _ip("link", "set", port, "up", netns=c.bridge_ns)
        _ip("addr", "add", f"{addr}/24", "dev", name, netns=self.netns)
        _ip("link", "set", name, "up", netns=self.netns)
        return addr

    def nic_carrier(self, name: str, *, up: bool) -> None:
        """Take the carrier of this host's NIC ``name`` away (``up=False``: its peer on the bridge
        goes down, as when its cable or switch port goes; the host's end stays configured and reads
        ``carrier`` 0, operstate ``down`` or ``lowerlayerdown``) or give it back."""
        _ip("link", "set", self.ports[name], "up" if up else "down", netns=self.cluster.bridge_ns)

    def shape(self, *, delay_ms: float = 0, loss_pct: float = 0, rate_mbit: float | None = None,
              netem: bool | None = None) -> str:
        """A slow or lossy link on the host's egress: delay, loss and/or a tbf bandwidth cap, by
        ``tc netem`` where the kernel has it (``netem=None``: ask ``Cluster.netem_missing``), else
        by iptables and a userspace NFQUEUE delayer (``netfault``). Replaces the previous shaping.
        Returns the mechanism, e.g. ``netem+tbf`` or ``nfqueue-delay+iptables-loss+tbf``."""
        self.unshape()
        if netem is None:
            netem = self.cluster.netem_missing() is None
        self.fault = netfault.LinkFault(self)
        try:
            return self.fault.apply(delay_ms=delay_ms, loss_pct=loss_pct, rate_mbit=rate_mbit, netem=netem)
        except BaseException:
            self.unshape()
            raise

    def unshape(self) -> None:
        """The link as it was: qdisc, iptables rules and delayer gone (idempotent)."""
        if self.fault is None:
            self.fault = netfault.LinkFault(self)  # a qdisc may be there without shape(): del is harmless
        self.fault.clear()


def wait_for(cond: Any, timeout: float, what: str, report: Any = None) -> Any:
    """Poll ``cond()`` until it is truthy or ``timeout`` passes (then fail, saying what was awaited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for: {what}\n{report() if report else ''}")
