"""Helpers for attacking an agent over its own wire protocol: raw handshakes (either side, TLS
included: the attacker holds no secret but may run TLS as well as anyone),
replica payloads built from a real save, agents in a subprocess with resource limits, and
the health check every attack ends with (alive, serving bit-for-bit, nothing touched
outside the root, descriptors/threads/RSS back to baseline)."""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.agent.conftest import wait_for
from tierckpt import layout
from tierckpt.agent import protocol as p
from tierckpt.agent.tls import ServerTLS, client_wrap, peer_end_point
from tierckpt.agent.wire import Connection

SECRET = b"job-secret-1"
NS = "agent-run"
REPO = Path(__file__).resolve().parents[2]


def raw_connect(address: tuple[str, int], *, source: str | None = None, timeout: float = 10.0) -> Connection:
    """A connection to an agent, ready for the handshake's first frame (the server's plaintext hello)."""
    sock = socket.create_connection(address, timeout=timeout, source_address=(source, 0) if source else None)
    return Connection(sock, step_timeout=timeout)


def client_hello(address: tuple[str, int], *, source: str | None = None, timeout: float = 10.0
                 ) -> tuple[Connection, dict[str, Any], bytes]:
    """Connect, read the hello and start TLS as it says: (connection, hello, channel binding for the MACs)."""
    conn = raw_connect(address, source=source, timeout=timeout)
    hello = conn.recv()
    wire = hello.get("wire", "")
    end_point = b""
    if wire == "tls13":
        conn.start_tls(client_wrap)
        end_point = peer_end_point(conn.sock)  # type: ignore[arg-type]
    return conn, hello, p.channel_binding(wire, end_point)


_FAKE_TLS: list[ServerTLS] = []


def fake_tls() -> ServerTLS:
    """One ephemeral certificate for every fake agent of the test session (made once: it takes a subprocess)."""
    if not _FAKE_TLS:
        _FAKE_TLS.append(ServerTLS.create())
    return _FAKE_TLS[0]


def raw_accept(listener: socket.socket, timeout: float = 5.0) -> Connection:
    """The server side of a fake agent: an accepted connection, ready to send a hello."""
    s, _ = listener.accept()
    return Connection(s, step_timeout=timeout)


def serve_hello(conn: Connection, node: str, nonce: str, wire: str = "tls13") -> bytes:
    """A fake agent's hello, then TLS with its own certificate: the channel binding for the MACs."""
    conn.send({"op": "hello", "node": node, "nonce": nonce, "wire": wire})
    if wire != "tls13":
        return p.channel_binding(wire, b"")
    tls = fake_tls()
    conn.start_tls(tls.wrap)
    return p.channel_binding(wire, tls.end_point)


def client_handshake(address: tuple[str, int], node: str, secret: bytes = SECRET, *,
                     source: str | None = None, timeout: float = 10.0) -> Connection:
    """Authenticate to an agent as ``node`` by hand (hello → TLS → auth → welcome → proof)."""
    conn, hello, binding = client_hello(address, source=source, timeout=timeout)
    mine = secrets.token_hex(32)
    conn.send({"op": "auth", "node": node, "nonce": mine})
    welcome = conn.recv()
    ids = (hello["nonce"], mine, hello["node"], node, binding)
    p.check_mac(p.server_mac(secret, *ids), welcome.get("mac"))
    conn.send({"op": "proof", "mac": p.client_mac(secret, *ids)})
    return conn


def payload(memory_dir: str, step: int, ns: str = NS) -> list[tuple[str, bytes]]:
    """A committed own step's files in put order (the sealed small files first)."""
    d = Path(memory_dir, ns, layout.step_dir_name(step))
    small = [(n, (d / n).read_bytes()) for n in (layout.METADATA, layout.MANIFEST, layout.MARKER)]
    return small + [(f.name, f.read_bytes()) for f in sorted(d.iterdir()) if f.name.endswith(".distcp")]


def put(conn: Connection, origin: str, step: int, files: list[tuple[str, bytes]], *, ns: str = NS,
        owner: str = "ab" * 32, keep: tuple[int, ...] = (), send: bool = True) -> dict[str, Any]:
    """A put by hand; the first answer, or (when ``ready`` and ``send``) the final one."""
    save_id = layout.check_marker(dict(files)[layout.MARKER], dict(files)[layout.MANIFEST], where="payload")
    conn.send({"op": "put", "ns": ns, "origin": origin, "step": step, "save_id": save_id, "owner": owner,
               "files": [[n, len(b)] for n, b in files], "keep": list(keep)})
    reply = conn.recv()
    if reply["op"] != "ready" or not send:
        return reply
    for _, data in files:
        conn.send_bytes(data)
    return conn.recv()


def get(conn: Connection, origin: str, step: int, name: str, ns: str = NS) -> bytes:
    conn.send({"op": "get", "ns": ns, "origin": origin, "step": step, "name": name})
    reply = conn.recv()
    if reply["op"] != "file":
        raise AssertionError(f"get {name}: {reply}")
    return conn.recv_bytes(reply["size"])


def closed_by_server(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Whether the agent closes ``sock`` within ``timeout`` (reading whatever it says first); closes it."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:  # before ssl.SSLError: a TLS read that times out raises it as TimeoutError
        return False
    except ssl.SSLError:  # ended by a TLS alert
        return True
    finally:
        sock.close()


# -- the agent's process: in this one, or a subprocess with limits ------------------------
def proc_stats(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": int(fields["Threads"]),
            "rss": int(fields["VmRSS"].split()[0]) * 1024}


def back_to_baseline(pid: int, base: dict[str, int], *, rss_slack: int = 48 << 20, timeout: float = 20.0) -> None:
    """Descriptors and threads return to the baseline (a little slack), RSS within ``rss_slack``."""
    def ok() -> bool:
        now = proc_stats(pid)
        return now["fds"] <= base["fds"] + 2 and now["threads"] <= base["threads"] + 2 and \
            now["rss"] <= base["rss"] + rss_slack
    try:
        wait_for(ok, "descriptors, threads and RSS back to baseline", timeout)
    except AssertionError:
        raise AssertionError(f"baseline {base}, now {proc_stats(pid)}") from None


_CHILD = r"""
import json, os, resource, sys, threading
from tierckpt.agent import AgentConfig, start_agent
from tierckpt.agent.config import AgentLimits
cfg = json.loads(sys.argv[1])
limits = AgentLimits(**cfg.pop("limits", {}))
peers = tuple(tuple(a) for a in cfg.pop("peers", []))
handle = start_agent(AgentConfig(secret=cfg.pop("secret").encode(), limits=limits, peers=peers, **cfg))
for name, value in json.loads(sys.argv[2]).items():
    what = getattr(resource, name)
    if name == "RLIMIT_NOFILE":
        value += len(os.listdir("/proc/self/fd"))
    if name == "RLIMIT_AS":
        value += int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
    resource.setrlimit(what, (value, resource.getrlimit(what)[1]))
print(json.dumps({"port": handle.address[1], "node": handle.node_id}), flush=True)
sys.stdin.read()
handle.close()
"""


@dataclass
class ChildAgent:
    proc: subprocess.Popen[str]
    address: tuple[str, int]
    node_id: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_child(memory_dir: str, node_id: str, *, rlimits: dict[str, int] | None = None,
                **config: Any) -> ChildAgent:
    """An agent in its own process (``rlimits``: RLIMIT_NOFILE / RLIMIT_AS above what it uses
    once started, RLIMIT_FSIZE as is); stop it with ``.stop()``."""
    import json

    cfg = {"memory_dir": memory_dir, "node_id": node_id, "secret": SECRET.decode(), "replicas": 0,
           "scan_interval_s": 0.2, **config}
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(cfg), json.dumps(rlimits or {})],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise AssertionError("the agent subprocess did not start")
    info = json.loads(line)
    return ChildAgent(proc, ("127.0.0.1", info["port"]), info["node"])


# -- what must hold after every attack -------------------------------------------------
def tree_digest(path: Path) -> str:
    """Names, modes, sizes and contents of everything under ``path`` (links not followed)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(path)):
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            h.update(f"{full}:{st.st_mode}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def serves_bit_for_bit(address: tuple[str, int], memory_dir: str, origin: str, step: int, *,
                       source: str | None = None, replica: bool = False) -> None:
    """A legitimate peer lists the step and gets every file identical to the bytes on disk."""
    conn = client_handshake(address, "node-legit", source=source)
    try:
        conn.send({"op": "list", "ns": NS})
        steps = []
        while True:
            reply = conn.recv()
            steps += reply["steps"]
            if not reply["more"]:
                break
        assert any(e["step"] == step and e["origin"] == origin for e in steps), steps
        base = Path(memory_dir, *([layout.REPLICAS, origin] if replica else []), NS, layout.step_dir_name(step))
        for f in sorted(base.iterdir()):
            assert get(conn, origin, step, f.name) == f.read_bytes(), f.name
    finally:
        conn.close()


def in_thread(fn: Callable[[], Any]) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def settle(seconds: float = 0.2) -> None:
    time.sleep(seconds)
