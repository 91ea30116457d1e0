"""The harness itself: hosts of their own (network, hostname, /dev/shm, processes) and its faults."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.cluster import netfault
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


def test_a_second_nic_loses_carrier_alone_and_the_host_reads_its_own_sysfs(cluster: Cluster) -> None:
    a, b = cluster.add_host(), cluster.add_host()
    a_addr, b_addr = a.add_nic("eth1"), b.add_nic("eth1")
    assert a_addr.rsplit(".", 1)[0] == b_addr.rsplit(".", 1)[0] == cluster.fabrics["eth1"] != cluster.subnet
    # the host's own interfaces in /sys/class/net (hostinit), as a launcher's nic health check reads them
    assert sorted(b.run(["ls", "/sys/class/net"]).stdout.split()) == ["eth0", "eth1", "lo"]

    def eth1() -> list[str]:  # carrier (unreadable while down: no carrier file), operstate, carrier_changes
        return b.run(["sh", "-c", "cd /sys/class/net/eth1 && cat carrier operstate carrier_changes"],
                     check=False).stdout.split()

    up = wait_for(lambda: (got := eth1())[:2] == ["1", "up"] and got, 20, "b's eth1 has carrier")
    _serve(b)
    assert _reach(a, b_addr, 5000)
    b.nic_carrier("eth1", up=False)
    down = wait_for(lambda: (got := eth1())[:1] == ["0"] and got, 20, "b's eth1 lost carrier")
    assert down[1] in ("down", "lowerlayerdown") and int(down[2]) > int(up[2]), (up, down)
    assert not _reach(a, b_addr, 5000, 1.0)
    assert _reach(a, b.ip, 5000)  # eth0 carries on
    b.nic_carrier("eth1", up=True)
    wait_for(lambda: eth1()[:2] == ["1", "up"], 20, "b's eth1 has carrier again")
    wait_for(lambda: _reach(a, b_addr, 5000, 1.0), 20, "eth1 carries again")


def _rtt(src: Host, ip: str) -> float:
    code = (f"import socket,time; s=socket.create_connection(({ip!r}, 5001)); t=time.perf_counter()\n"
            "for _ in range(5): s.sendall(b'x'); s.recv(1)\n"
            "print((time.perf_counter()-t)/5)")
    return float(src.run([PY, "-c", code]).stdout)


def _echo(host: Host) -> None:
    host.popen([PY, "-c", "import socket; s=socket.socket(); s.bind(('0.0.0.0', 5001)); s.listen(8)\n"
                "while True:\n c,_=s.accept()\n while (d:=c.recv(1)): c.sendall(d)"])
    wait_for(lambda: _reach(host, "127.0.0.1", 5001, 0.5), 30, "echo server")


MECHANISMS = ("netem", "nfqueue")  # tc netem where the kernel has it; else iptables + NFQUEUE (netfault)


def _via(cluster: Cluster, via: str) -> bool:
    """``netem=`` for ``Host.shape`` to use ``via``; skips, saying why, where it cannot work here."""
    missing = cluster.netem_missing() if via == "netem" else netfault.fallback_missing(cluster.bridge_ns)
    if missing:
        pytest.skip(missing)
    return via == "netem"


@pytest.mark.parametrize("via", MECHANISMS)
def test_delay_is_measurable_and_unshape_restores(cluster: Cluster, via: str) -> None:
    a, b = cluster.add_host(), cluster.add_host()
    netem = _via(cluster, via)
    _echo(b)
    base = _rtt(a, b.ip)
    assert b.shape(delay_ms=50, netem=netem) == ("netem" if netem else "nfqueue-delay")
    slow = _rtt(a, b.ip)
    # b's replies wait 50 ms (its egress only); a late scheduler adds, nothing takes away
    assert base + 0.045 <= slow < base + 0.5, (base, slow)
    b.unshape()
    after = _rtt(a, b.ip)
    assert after < 0.025, (base, slow, after)
    if not netem:  # the delayer let every packet through, none unread
        counts = b.fault.delayer_counts if b.fault else {}
        assert counts["queued"] >= 5 and counts["accepted"] == counts["queued"] and not counts["unparsed"], counts
    assert "TCKFAULT" not in _bridge_rules(cluster)


def _bridge_rules(cluster: Cluster) -> str:
    """The iptables rules in the bridge's namespace (where the fallback's faults act)."""
    return subprocess.run(["nsenter", f"--net=/run/netns/{cluster.bridge_ns}", "iptables-legacy", "-w", "30", "-S"],
                          capture_output=True, text=True, timeout=60).stdout


def _udp_burst(src: Host, dst: Host, n: int, size: int = 64) -> dict[str, float]:
    """``n`` numbered datagrams of ``size`` bytes from ``src`` to ``dst`` as fast as the socket
    takes them: ``received`` (distinct), ``first_s`` (first arrival after the first send),
    ``span_s`` (first to last arrival), ``send_errors`` (sendto failures the sender saw)."""
    recv = ("import json,socket,time; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "s.setsockopt(socket.SOL_SOCKET, 33, 16 << 20); s.bind(('0.0.0.0', 5003)); print('listening', flush=True)\n"
            "s.settimeout(60); seen=set(); first=last=0.0\n"
            "while True:\n"
            " try: d=s.recv(65536)\n"
            " except TimeoutError: break\n"
            " last=time.time(); first=first or last; seen.add(d[:4]); s.settimeout(3)\n"
            "print(json.dumps({'received': len(seen), 'first': first, 'last': last}))")
    send = (f"import json,socket,time; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); errors=0; t=time.time()\n"
            f"for i in range({n}):\n"
            f" try: s.sendto(i.to_bytes(4, 'big') + bytes({size - 4}), ({dst.ip!r}, 5003))\n"
            f" except OSError: errors += 1\n"
            f"print(json.dumps({{'start': t, 'send_errors': errors}}))")
    sink = dst.popen([PY, "-c", recv], stdout=subprocess.PIPE, text=True)
    assert sink.stdout is not None and sink.stdout.readline().strip() == "listening"
    sent = json.loads(src.run([PY, "-c", send], timeout=120).stdout)
    got = json.loads(sink.communicate(timeout=120)[0])
    return {"received": got["received"], "first_s": got["first"] - sent["start"] if got["first"] else -1.0,
            "span_s": got["last"] - got["first"], "send_errors": sent["send_errors"]}


@pytest.mark.parametrize("via", MECHANISMS)
def test_loss_is_measurable_and_unshape_restores(cluster: Cluster, via: str) -> None:
    a, b = cluster.add_host(), cluster.add_host()
    netem = _via(cluster, via)
    n = 2000
    assert a.shape(loss_pct=20, netem=netem) == ("netem" if netem else "iptables-loss")
    lossy = _udp_burst(a, b, n)
    # 20 % of 2000: 400 +- 18 (one standard deviation) lost; the sender is told nothing, as on a wire
    assert 0.70 <= lossy["received"] / n <= 0.90 and lossy["send_errors"] == 0, lossy
    a.unshape()
    clean = _udp_burst(a, b, n)
    assert clean["received"] == n and clean["send_errors"] == 0, clean


def test_delay_loss_and_rate_combine(cluster: Cluster) -> None:
    a, b = cluster.add_host(), cluster.add_host()
    missing = cluster.shaping_missing()
    if missing:
        pytest.skip(missing)
    mechanism = a.shape(delay_ms=40, loss_pct=10, rate_mbit=8)  # 1 MB/s
    assert mechanism in ("netem+tbf", "nfqueue-delay+iptables-loss+tbf"), mechanism
    n, size = 400, 1000  # 400 kB: within tbf's queue (400 ms at 1 MB/s), so tbf itself drops none
    burst = _udp_burst(a, b, n, size)
    assert 0.80 <= burst["received"] / n <= 0.97, burst  # 10 %: 40 +- 6 lost
    assert burst["first_s"] >= 0.038, burst  # the delay (a late scheduler only adds)
    assert burst["span_s"] >= 0.25, burst  # ~360 kB at 1 MB/s: ~0.36 s; uncapped a few ms
    _echo(b)
    assert _rtt(a, b.ip) >= 0.038  # TCP sees the delay too (lost segments only add)
    a.unshape()
    clean = _udp_burst(a, b, n, size)
    assert clean["received"] == n and clean["first_s"] < 0.03 and clean["span_s"] < 0.2, clean
    if a.fault is not None and a.fault.delayer_counts:
        counts = a.fault.delayer_counts
        assert counts["accepted"] == counts["queued"] > 0 and not counts["unparsed"], counts


def test_the_delayer_goes_when_its_harness_does_and_packets_pass(cluster: Cluster) -> None:
    a, b = cluster.add_host(), cluster.add_host()
    _via(cluster, "nfqueue")
    _echo(b)
    b.shape(delay_ms=50, netem=False)
    assert _rtt(a, b.ip) >= 0.045
    assert b.fault is not None and b.fault.delayer is not None
    delayer = b.fault.delayer
    assert delayer.stdin is not None
    delayer.stdin.close()  # what the harness's end does to the pipe
    delayer.wait(timeout=30)
    # the rule is still there, the queue has no program: --queue-bypass, not a black hole
    assert f"-A TCKFAULT-{b.bridge_port} -j NFQUEUE" in _bridge_rules(cluster)
    assert _rtt(a, b.ip) < 0.025
    b.unshape()
    assert "TCKFAULT" not in _bridge_rules(cluster)


def test_killing_a_shaped_host_clears_its_faults(cluster: Cluster) -> None:
    a, b = cluster.add_host(), cluster.add_host()
    _via(cluster, "nfqueue")
    assert b.shape(delay_ms=20, loss_pct=5, netem=False) == "nfqueue-delay+iptables-loss"
    assert b.fault is not None and b.fault.delayer is not None
    delayer = b.fault.delayer
    assert f"--physdev-in {b.bridge_port}" in _bridge_rules(cluster)
    b.kill()
    assert delayer.poll() is not None and "TCKFAULT" not in _bridge_rules(cluster)
    left = cluster.leftovers()
    assert b.netns not in left and f"pid {delayer.pid}" not in left and a.netns in left, left


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
    for host in (a, b):
        host.add_nic("eth1")  # its veth pairs and bridge go too
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
