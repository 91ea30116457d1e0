"""The harness itself: hosts of their own (network, hostname, /dev/shm, processes) and its faults."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.cluster.hosts import Cluster, Host, wait_for

PY = sys.executable


def _reach(src: Host, ip: str, port: int, timeout: float = 2.0) -> bool:
    """A TCP connect from ``src`` to ``ip:port`` succeeds within ``timeout``."""
    code = (f"import socket; s=socket.socket(); s.settimeout({timeout}); "
            f"s.connect(({ip!r}, {port})); s.close()")
    return src.run([PY, "-c", code], check=False, timeout=timeout + 30).returncode == 0


def _serve(host: Host, port: int = 5000) -> None:
    host.popen([PY, "-c", f"import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, "
                f"socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', {port})); s.listen(64)\n"
                "while True: c,_=s.accept(); c.close()"])
    wait_for(lambda: _reach(host, "127.0.0.1", port, 0.5), 30, f"a listener on {host.name}:{port}")


def test_hosts_reach_each_other_by_ip_and_name_but_not_the_machines_loopback(cluster: Cluster) -> None:
    a, b = cluster.add_host(), cluster.add_host()
    assert a.ip != b.ip and a.ip.rsplit(".", 1)[0] == b.ip.rsplit(".", 1)[0] == cluster.subnet
    _serve(b)
    assert _reach(a, b.ip, 5000)
    assert _reach(a, b.name, 5000)  # through the run's hosts file
    with socket.socket() as machine:  # a service on the machine's own loopback
        machine.bind(("127.0.0.1", 0))
        machine.listen(1)
        port = machine.getsockname()[1]
        assert not _reach(a, "127.0.0.1", port, 0.5)
    assert a.run(["ip", "-4", "-o", "addr", "show", "eth0"]).stdout.split()[3] == f"{a.ip}/24"


def test_own_hostname_and_own_dev_shm(cluster: Cluster) -> None:
    a, b = cluster.add_host(), cluster.add_host()
    assert a.run(["hostname"]).stdout.strip() == a.name and b.run(["hostname"]).stdout.strip() == b.name
    tag = f"tck-{cluster.prefix}"
    a.run(["sh", "-c", f"echo data > /dev/shm/{tag}"])
    assert a.run(["cat", f"/dev/shm/{tag}"]).stdout == "data\n"
    assert b.run(["test", "-e", f"/dev/shm/{tag}"], check=False).returncode == 1
    assert not os.path.exists(f"/dev/shm/{tag}")
    assert a.run(["stat", "-f", "-c", "%T", "/dev/shm"]).stdout.strip() == "tmpfs"


def test_killing_a_host_kills_all_its_processes_and_its_memory(cluster: Cluster) -> None:
    a = cluster.add_host()
    a.run(["sh", "-c", "echo data > /dev/shm/x"])
    sleepers = [a.popen(["sleep", "600"]) for _ in range(3)]
    # a process that left its parent (reparented to the host's init) and one in its own session
    a.run(["sh", "-c", "setsid sleep 600 > /dev/null 2>&1 < /dev/null &"])
    pids_inside = a.run(["sh", "-c", "ls /proc | grep -E '^[0-9]+$'"]).stdout.split()
    assert len(pids_inside) >= 5, pids_inside
    machine_pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _in_mnt_ns(int(p), a.mnt_ns)]
    assert len(machine_pids) >= 6  # init, 4 sleeps, nsenters
    mnt_ns = a.mnt_ns
    a.kill()
    assert all(s.poll() is not None for s in sleepers)
    assert not [p for p in machine_pids if _exists(p)]
    # nothing holds the host's mount namespace any more: its /dev/shm tmpfs is unmounted and freed
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _in_mnt_ns(int(p), mnt_ns)]
    assert a.netns not in cluster.namespaces
    b = cluster.add_host()  # the replacement: a new address and an empty /dev/shm
    assert b.ip != a.ip and b.run(["ls", "-A", "/dev/shm"]).stdout == ""


def test_link_down_partitions_and_up_heals(cluster: Cluster) -> None:
    a, b = cluster.add_host(), cluster.add_host()
    _serve(b)
    b.link(up=False)
    assert not _reach(a, b.ip, 5000, 1.0)
    b.link(up=True)
    wait_for(lambda: _reach(a, b.ip, 5000, 1.0), 20, "the healed link carries again")


def _rtt(src: Host, ip: str) -> float:
    code = (f"import socket,time; s=socket.create_connection(({ip!r}, 5001)); t=time.perf_counter()\n"
            "for _ in range(5): s.sendall(b'x'); s.recv(1)\n"
            "print((time.perf_counter()-t)/5)")
    return float(src.run([PY, "-c", code]).stdout)


def _echo(host: Host) -> None:
    host.popen([PY, "-c", "import socket; s=socket.socket(); s.bind(('0.0.0.0', 5001)); s.listen(8)\n"
                "while True:\n c,_=s.accept()\n while (d:=c.recv(1)): c.sendall(d)"])
    wait_for(lambda: _reach(host, "127.0.0.1", 5001, 0.5), 30, "echo server")


def test_netem_delay_is_measurable(cluster: Cluster) -> None:
    a, b = cluster.add_host(), cluster.add_host()
    missing = cluster.netem_missing()
    if missing:
        pytest.skip(missing)
    _echo(b)
    base = _rtt(a, b.ip)
    b.shape(delay_ms=50)
    slow = _rtt(a, b.ip)
    assert slow >= base + 0.045, (base, slow)
    b.unshape()


def test_tbf_caps_bandwidth(cluster: Cluster) -> None:
    a, b = cluster.add_host(), cluster.add_host()
    sink = ("import socket; s=socket.socket(); s.bind(('0.0.0.0', 5002)); s.listen(1); c,_=s.accept()\n"
            "while c.recv(1 << 16): pass")
    send = (f"import socket,time; s=socket.create_connection(({b.ip!r}, 5002)); t=time.perf_counter(); "
            "s.sendall(bytes(2_000_000)); s.shutdown(socket.SHUT_WR); s.recv(1); print(time.perf_counter()-t)")

    def seconds_for_2mb() -> float:
        b.popen([PY, "-c", sink])
        time.sleep(0.5)
        return float(a.run([PY, "-c", send], timeout=120).stdout)

    fast = seconds_for_2mb()
    a.shape(rate_mbit=8)  # 1 MB/s: 2 MB take ~2 s
    capped = seconds_for_2mb()
    assert capped >= 1.5 and capped > 5 * fast, (fast, capped)


def test_close_leaves_nothing(namespaces: None, tmp_path: os.PathLike[str]) -> None:
    from pathlib import Path

    cluster = Cluster(Path(tmp_path) / "c")
    a, b = cluster.add_host(), cluster.add_host()
    a.popen(["sleep", "600"])
    b.run(["sh", "-c", "setsid sleep 600 > /dev/null 2>&1 < /dev/null &"])
    pids = [a.init_pid, b.init_pid, *a.pids_started, *b.pids_started]
    cluster.close()
    assert cluster.leftovers() == []
    assert not [p for p in pids if _exists(p)]
    listed = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    links = [line for line in listed.splitlines() if cluster.prefix in line]
    assert links == []


def _in_mnt_ns(pid: int, ns: str) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt") == ns
    except OSError:
        return False


def _exists(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1][:1]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")
