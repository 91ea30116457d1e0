"""Checks ``tierckpt run`` makes before any worker starts; each raises ``ConfigError`` (exit 2).

Call order: ``cli._validate`` calls ``check_writable_dir`` (--memory-dir), ``check_writable_file``
(--events), ``check_port`` (--server-port), ``check_endpoint`` (--rdzv-endpoint) and ``check_script`` (the training script),
before the agent exists; a failure is one ``tierckpt run: error: ...`` line.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time

from tierckpt.errors import ConfigError

__all__ = ["RESOLVE_WAIT_S", "check_endpoint", "check_port", "check_script", "check_writable_dir",
           "check_writable_file"]

_DEFAULT_RDZV_PORT = 29400  # torch's c10d rendezvous default


def _existing_ancestor(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def check_writable_dir(option: str, path: str) -> None:
    """``path`` is a writable folder, or can be created (its nearest existing parent is writable)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConfigError(f"{option} {path} is not a folder; give a folder (it is created if missing)")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{option} {path} is not writable by this user; fix its permissions or pick another")
        return
    base = _existing_ancestor(path)
    if not os.path.isdir(base) or not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {path} cannot be created: {base} is not a writable folder; "
                          "create it or pick another path")


def check_writable_file(option: str, path: str) -> None:
    """``path`` can be appended to: its folder exists and is writable (and the file, if it exists)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{option} {path}: the folder {folder} does not exist; create it first")
    if os.path.exists(path):
        if os.path.isdir(path) or not os.access(path, os.W_OK):
            raise ConfigError(f"{option} {path} is not a writable file; fix its permissions or pick another")
    elif not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {path}: the folder {folder} is not writable by this user; pick another")


def check_port(option: str, host: str, port: int) -> None:
    """``host:port`` is a TCP port this process can listen on now (0: any free one)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"{option} must be a TCP port 0-65535 (0: any free one), got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"{option}: the host {host!r} does not resolve ({exc.strerror}); give an address "
                          "such as 127.0.0.1 or 0.0.0.0") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise ConfigError(f"{option} {port} on {host}: cannot listen ({exc.strerror or exc}); pick a free "
                              "port, or 0 for any") from None


#: how long a rendezvous host that does not resolve yet is waited for (a Kubernetes headless
#: service's name appears seconds after the pods start)
RESOLVE_WAIT_S = 30.0


def check_endpoint(endpoint: str, *, wait_s: float = RESOLVE_WAIT_S) -> tuple[str, int]:
    """``HOST[:PORT]`` (torch's syntax, IPv6 in brackets) whose host resolves within ``wait_s``
    (one line on stderr says it is waited for); (host, port)."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        host, port = parse_rendezvous_endpoint(endpoint, default_port=_DEFAULT_RDZV_PORT)
    except ValueError as exc:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT ({exc}); e.g. head-node:29400") from None
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            return host, port
        except UnicodeError as exc:
            raise ConfigError(f"--rdzv-endpoint {endpoint!r}: {host!r} is not a host name ({exc})") from None
        except socket.gaierror as exc:
            if time.monotonic() >= deadline:
                raise ConfigError(f"--rdzv-endpoint {endpoint!r}: host {host!r} does not resolve ({exc}); give "
                                  "the rendezvous host's name or address as every node can reach it") from None
            if not told:
                print(f"tierckpt run: waiting up to {wait_s:g}s for {host} to resolve ({exc})", file=sys.stderr,
                      flush=True)
                told = True
            time.sleep(1.0)


def check_script(script: str | None, *, module: bool, no_python: bool) -> None:
    """The training script exists (a file; with --no-python, an executable file or a command on
    PATH); a ``-m`` module is left to the interpreter."""
    if module or script is None:
        return
    if no_python:
        if os.path.sep not in script and shutil.which(script) is not None:
            return
        if os.path.isfile(script) and os.access(script, os.X_OK):
            return
        raise ConfigError(f"training command {script!r} is not an executable file or a command on PATH")
    if not os.path.isfile(script):
        where = f" (relative to {os.getcwd()})" if not os.path.isabs(script) else ""
        raise ConfigError(f"training script {script!r} does not exist{where}; check the path, or use -m for a module")
