"""``tierckpt bench wire``: ways to authenticate the peer stream, against a plain socket copy, same run.

    tierckpt bench wire [--size-mib 512] [--rounds 3] [--only NAME,...] [--json PATH]

One file of ``--size-mib`` in /dev/shm moves over loopback TCP from a sender process (pinned
to core 0) to a receiver process (pinned to core 1) that writes it into a tmpfs file, as a
replica is written. Each candidate is timed from the first byte sent (after any handshake)
to the last byte written; CPU seconds (user + system, all threads) are taken on each end.

  plain            sendfile → recv_into + write: the anchor, nothing authenticated
  agent-tls        the agent's own bulk path (``agent.wire.Connection``): TLS 1.3, segment markers
  agent-insecure   the same without TLS (``--insecure-wire``): sendfile, segment markers
  tls13            TLS 1.3 (``ssl``, OpenSSL's default suite, AES-256-GCM here): sendall of the
                   mapped file → recv_into + write
  tls13-pipe       the same, the receiver's writes on a thread beside the socket
  tls13-bio        the same TLS through memory BIOs (``ssl.SSLObject``): ~16 records per send()
                   and up to 1 MiB per recv_into, instead of one system call (or two) per record
  hmac-sha256      the old wire: SHA-256 per 8 MiB segment + HMAC tag, one thread per end
  hmac-sha256-pipe hashing on a thread beside the socket on each end (hashlib drops the GIL)
  gmac             AES-GMAC per segment (``cryptography``'s AESGCM over the segment as AAD)
  blake3 / blake3-mt  keyed BLAKE3 per segment (``blake3``), one thread / all cores
Optional candidates whose package is missing are reported as skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import mmap
import multiprocessing as mp
import os
import queue
import resource
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["main"]

SEGMENT = 8 << 20
PIECE = 1 << 20
TLS_WRITE = 256 << 10  # what tierckpt.agent.wire writes at a time: 8 MiB writes cost ~2.8x the CPU
KEY = b"k" * 32

Sender = Callable[[socket.socket, int, int], None]  # (sock, fd, size)
Receiver = Callable[[socket.socket, int, int], None]


# -- digests per segment: (name, make) where make() gives a fresh hasher-like digest function --
def _sha_tag(seq: int, seg: memoryview) -> bytes:
    return hmac.new(KEY, seq.to_bytes(8, "big") + hashlib.sha256(seg).digest(), hashlib.sha256).digest()


def _gmac_tag() -> Callable[[int, memoryview], bytes]:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(KEY)
    return lambda seq, seg: aead.encrypt(seq.to_bytes(12, "big"), b"", bytes(seg))


def _blake3_tag(threads: int) -> Callable[[int, memoryview], bytes]:
    import blake3

    def tag(seq: int, seg: memoryview) -> bytes:
        h = blake3.blake3(seq.to_bytes(8, "big"), key=KEY, max_threads=threads)
        h.update(seg)
        return bytes(h.digest())
    return tag


def _tagger(name: str) -> Callable[[int, memoryview], bytes]:
    if name.startswith("hmac"):
        return _sha_tag
    if name.startswith("gmac"):
        return _gmac_tag()
    if name.startswith("blake3-mt"):
        import blake3
        return _blake3_tag(blake3.blake3.AUTO)
    return _blake3_tag(1)


# -- senders -------------------------------------------------------------------------
def _send_plain(sock: socket.socket, fd: int, size: int) -> None:
    sent = 0
    while sent < size:
        sent += os.sendfile(sock.fileno(), fd, sent, size - sent)


def _send_tagged(tag: Callable[[int, memoryview], bytes], pipelined: bool) -> Sender:
    def send(sock: socket.socket, fd: int, size: int) -> None:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            view = memoryview(mm)
            segs = [(i, pos, min(SEGMENT, size - pos)) for i, pos in enumerate(range(0, size, SEGMENT))]
            tags: queue.Queue[bytes] = queue.Queue()
            def ahead() -> None:  # digests computed ahead on a thread: the socket never waits for a hash
                for i, pos, n in segs:
                    tags.put(tag(i, view[pos:pos + n]))
            t = threading.Thread(target=ahead)
            if pipelined:
                t.start()
            for i, pos, n in segs:
                digest = tags.get() if pipelined else tag(i, view[pos:pos + n])
                done = 0
                while done < n:
                    done += os.sendfile(sock.fileno(), fd, pos + done, n - done)
                sock.sendall(digest)
            if pipelined:
                t.join()
            view.release()
    return send


def _send_tls(sock: socket.socket, fd: int, size: int) -> None:
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
        view = memoryview(mm)
        for pos in range(0, size, TLS_WRITE):
            sock.sendall(view[pos:pos + TLS_WRITE])
        view.release()


# -- receivers -----------------------------------------------------------------------
def _write(fd: int, piece: memoryview) -> None:
    done = 0
    while done < len(piece):
        done += os.write(fd, piece[done:])


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("closed early")
        got += k


def _recv_plain(sock: socket.socket, fd: int, size: int) -> None:
    view = memoryview(bytearray(PIECE))
    left = size
    while left:
        k = sock.recv_into(view[: min(PIECE, left)])
        if not k:
            raise ConnectionError("closed early")
        _write(fd, view[:k])
        left -= k


def _recv_tls_pipe(sock: socket.socket, fd: int, size: int) -> None:
    """Segments received into two buffers in turn; a thread writes the other one meanwhile."""
    bufs = [memoryview(bytearray(SEGMENT)) for _ in range(2)]
    todo: queue.Queue[tuple[int, int] | None] = queue.Queue()
    free: queue.Queue[int] = queue.Queue()
    for i in range(len(bufs)):
        free.put(i)

    def writer() -> None:
        while (job := todo.get()) is not None:
            _write(fd, bufs[job[0]][: job[1]])
            free.put(job[0])
    t = threading.Thread(target=writer)
    t.start()
    for pos in range(0, size, SEGMENT):
        i, n = free.get(), min(SEGMENT, size - pos)
        _recv_exact(sock, bufs[i][:n])
        todo.put((i, n))
    todo.put(None)
    t.join()


def _recv_tagged(tag: Callable[[int, memoryview], bytes], pipelined: bool) -> Receiver:
    def recv(sock: socket.socket, fd: int, size: int) -> None:
        nseg = (size + SEGMENT - 1) // SEGMENT
        bufs = [memoryview(bytearray(SEGMENT)) for _ in range(2)]
        tagbuf = memoryview(bytearray(len(tag(0, memoryview(b"")))))
        work: queue.Queue[tuple[int, int, int, bytes] | None] = queue.Queue()
        free: queue.Queue[int] = queue.Queue()
        for b in range(len(bufs)):
            free.put(b)
        failed: list[int] = []

        def check(i: int, b: int, n: int, got: bytes) -> None:
            seg = bufs[b][:n]
            if not hmac.compare_digest(tag(i, seg), got):
                failed.append(i)
            _write(fd, seg)
            free.put(b)

        def worker() -> None:
            while (job := work.get()) is not None:
                check(*job)
        t = threading.Thread(target=worker) if pipelined else None
        if t is not None:
            t.start()
        for i in range(nseg):
            b, n = free.get(), min(SEGMENT, size - i * SEGMENT)
            _recv_exact(sock, bufs[b][:n])
            _recv_exact(sock, tagbuf)
            if t is not None:
                work.put((i, b, n, bytes(tagbuf)))
            else:
                check(i, b, n, bytes(tagbuf))
        if t is not None:
            work.put(None)
            t.join()
        if failed:
            raise ValueError(f"segments {failed} failed their tags")
    return recv


# -- TLS 1.3 through memory BIOs: records batched into large socket writes and reads ---------
def _bio(sock: socket.socket, server: bool) -> tuple[Any, Any, Any]:
    """(SSLObject, incoming BIO, outgoing BIO) after a TLS 1.3 handshake driven over ``sock``."""
    import ssl

    from tierckpt.agent.tls import ServerTLS, _client_context

    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    ctx = ServerTLS.create().context if server else _client_context()
    obj = ctx.wrap_bio(inc, out, server_side=server)
    while True:
        try:
            obj.do_handshake()
            done = True
        except ssl.SSLWantReadError:
            done = False
        if out.pending:
            sock.sendall(out.read())
        if done:
            return obj, inc, out
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("closed in the TLS handshake")
        inc.write(chunk)


def _send_tls_bio(sock: socket.socket, fd: int, size: int) -> None:
    obj, _, out = _bio(sock, server=False)
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
        view = memoryview(mm)
        for pos in range(0, size, TLS_WRITE):
            obj.write(view[pos:pos + TLS_WRITE])
            sock.sendall(out.read())  # ~16 records in one system call
        view.release()


def _recv_tls_bio(sock: socket.socket, fd: int, size: int) -> None:
    import ssl

    obj, inc, _ = _bio(sock, server=True)
    raw = memoryview(bytearray(PIECE))
    piece = memoryview(bytearray(PIECE))
    left, filled = size, 0
    while left:
        k = sock.recv_into(raw)
        if not k:
            raise ConnectionError("closed early")
        inc.write(raw[:k])
        while True:
            try:
                n = obj.read(min(PIECE, left) - filled, piece[filled:])
            except ssl.SSLWantReadError:
                break
            filled += n
            if filled == min(PIECE, left):
                _write(fd, piece[:filled])
                left -= filled
                filled = 0
                if not left:
                    break


# -- the agent's own wire (tierckpt.agent.wire.Connection), its handshake untimed ----------
def _send_agent(sock: socket.socket, fd: int, size: int) -> None:
    from tierckpt.agent.wire import Connection

    Connection(sock).send_fd(fd, 0, size)


def _recv_agent(sock: socket.socket, fd: int, size: int) -> None:
    from tierckpt.agent.wire import Connection

    Connection(sock).recv_into_file(fd, size)


CANDIDATES: dict[str, Callable[[], tuple[Sender, Receiver, str]]] = {
    "plain": lambda: (_send_plain, _recv_plain, "none"),
    "agent-tls": lambda: (_send_agent, _recv_agent, "tls"),
    "agent-insecure": lambda: (_send_agent, _recv_agent, "none"),
    "tls13": lambda: (_send_tls, _recv_plain, "tls"),
    "tls13-pipe": lambda: (_send_tls, _recv_tls_pipe, "tls"),
    "tls13-bio": lambda: (_send_tls_bio, _recv_tls_bio, "none"),  # its own handshake over the plain socket
    "hmac-sha256": lambda: (_send_tagged(_sha_tag, False), _recv_tagged(_sha_tag, False), "none"),
    "hmac-sha256-pipe": lambda: (_send_tagged(_sha_tag, True), _recv_tagged(_sha_tag, True), "none"),
    "gmac": lambda: (_send_tagged(_tagger("gmac"), False), _recv_tagged(_tagger("gmac"), False), "none"),
    "gmac-pipe": lambda: (_send_tagged(_tagger("gmac"), True), _recv_tagged(_tagger("gmac"), True), "none"),
    "blake3": lambda: (_send_tagged(_tagger("blake3"), False), _recv_tagged(_tagger("blake3"), False), "none"),
    "blake3-pipe": lambda: (_send_tagged(_tagger("blake3"), True), _recv_tagged(_tagger("blake3"), True), "none"),
    "blake3-mt": lambda: (_send_tagged(_tagger("blake3-mt"), False), _recv_tagged(_tagger("blake3-mt"), False),
                          "none"),
}


def _tls_contexts() -> tuple[Any, Any]:
    from tierckpt.agent.tls import ServerTLS, client_wrap

    return ServerTLS.create(), client_wrap


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _pin(core: int) -> None:
    if len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[core]})


def _receiver_proc(name: str, port_q: Any, out: Any, dest: str, size: int) -> None:
    _pin(1)
    _, recv, kind = CANDIDATES[name]()
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    sock, _ = srv.accept()
    srv.close()
    if kind == "tls":
        server, _ = _tls_contexts()
        sock = server.wrap(sock)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    c0 = _cpu()
    recv(sock, fd, size)
    end, cpu = time.monotonic(), _cpu() - c0
    os.close(fd)
    sock.close()
    out.put({"end": end, "cpu": cpu})


def _sender_proc(name: str, port: int, out: Any, src: str, size: int) -> None:
    _pin(0)
    send, _, kind = CANDIDATES[name]()
    sock = socket.create_connection(("127.0.0.1", port))
    if kind == "tls":
        _, client_wrap = _tls_contexts()
        sock = client_wrap(sock)
    fd = os.open(src, os.O_RDONLY)
    c0 = _cpu()
    start = time.monotonic()
    send(sock, fd, size)
    cpu = _cpu() - c0
    os.close(fd)
    sock.close()
    out.put({"start": start, "cpu": cpu})


def one_round(name: str, src: Path, dest: Path) -> dict[str, float]:
    size = src.stat().st_size
    ctx = mp.get_context("fork")
    port_q, rq, sq = ctx.Queue(), ctx.Queue(), ctx.Queue()
    r = ctx.Process(target=_receiver_proc, args=(name, port_q, rq, str(dest), size))
    r.start()
    s = ctx.Process(target=_sender_proc, args=(name, port_q.get(timeout=60), sq, str(src), size))
    s.start()
    got: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + 600
    while len(got) < 2:  # a side that died is noticed at once, not after the deadline
        for side, q, proc in (("s", sq, s), ("r", rq, r)):
            if side not in got:
                try:
                    got[side] = q.get(timeout=0.2)
                except queue.Empty:
                    if (proc.exitcode is not None and proc.exitcode != 0) or time.monotonic() > deadline:
                        s.kill()
                        r.kill()
                        raise RuntimeError(f"{name}: the {'sender' if side == 's' else 'receiver'} failed") from None
    got_s, got_r = got["s"], got["r"]
    s.join(60)
    r.join(60)
    if s.exitcode or r.exitcode:
        raise RuntimeError(f"{name}: sender exit {s.exitcode}, receiver exit {r.exitcode}")
    if dest.stat().st_size != size:
        raise RuntimeError(f"{name}: {dest.stat().st_size} of {size} bytes arrived")
    seconds = got_r["end"] - got_s["start"]
    return {"seconds": seconds, "send_cpu": got_s["cpu"], "recv_cpu": got_r["cpu"]}


def available(name: str) -> bool:
    mod = {"gmac": "cryptography", "blake3": "blake3"}.get(name.split("-")[0])
    if mod is None:
        return True
    try:
        __import__(mod)
    except ImportError:
        return False
    return True


def run(size_mib: int, rounds: int, names: list[str], workdir: Path) -> dict[str, Any]:
    src, dest = workdir / "src", workdir / "dest"
    with open(src, "wb") as f:
        for _ in range(size_mib):
            f.write(os.urandom(1 << 20))
    size = src.stat().st_size
    figs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for _ in range(rounds):  # interleaved: a change in the box's load hits every candidate alike
        for n in names:
            figs[n].append(one_round(n, src, dest))
            if n != "plain" and dest.read_bytes() != src.read_bytes():
                raise RuntimeError(f"{n}: the bytes differ")
            dest.unlink()
    gb = size / 1e9
    out: dict[str, Any] = {"bytes": size, "rounds": rounds, "candidates": {}}
    base = statistics.median(r["seconds"] for r in figs["plain"])
    for n, rs in figs.items():
        sec = statistics.median(r["seconds"] for r in rs)
        out["candidates"][n] = {"seconds": sec, "GBps": gb / sec, "vs_plain": base / sec,
                                "send_cpu_s_per_GB": statistics.median(r["send_cpu"] for r in rs) / gb,
                                "recv_cpu_s_per_GB": statistics.median(r["recv_cpu"] for r in rs) / gb}
    return out


def _report(out: dict[str, Any]) -> list[str]:
    c = out["candidates"]
    plain = c["plain"]
    lines = [f"{out['bytes'] / 2**20:.0f} MiB over loopback, sender on core 0, receiver on core 1, "
             f"medians of {out['rounds']} rounds",
             f"{'candidate':<18}{'GB/s':>7}{'x plain':>9}{'send CPU s/GB':>15}{'recv CPU s/GB':>15}{'CPU x plain':>13}"]
    for n, f in c.items():
        cpu_ratio = max(f["send_cpu_s_per_GB"] / max(plain["send_cpu_s_per_GB"], 1e-9),
                        f["recv_cpu_s_per_GB"] / max(plain["recv_cpu_s_per_GB"], 1e-9))
        lines.append(f"{n:<18}{f['GBps']:>7.2f}{f['vs_plain']:>9.2f}{f['send_cpu_s_per_GB']:>15.3f}"
                     f"{f['recv_cpu_s_per_GB']:>15.3f}{cpu_ratio:>13.2f}")
    lines.append("goal: authenticated >= 0.9 x plain, CPU per GB <= 1.3 x plain's on each end")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tierckpt bench wire", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default="", help="comma-separated candidates (plain is always run)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if args.size_mib < 1 or args.rounds < 1:
        p.error("--size-mib and --rounds must be >= 1")
    wanted = [n for n in args.only.split(",") if n] or list(CANDIDATES)
    unknown = [n for n in wanted if n not in CANDIDATES]
    if unknown:
        p.error(f"unknown candidates {unknown}; choose from {', '.join(CANDIDATES)}")
    names = ["plain"] + [n for n in wanted if n != "plain" and available(n)]
    skipped = [n for n in wanted if n not in names]
    workdir = Path(tempfile.mkdtemp(prefix="tierckpt-bench-wire-", dir="/dev/shm"))
    try:
        out = run(args.size_mib, args.rounds, names, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out["skipped"] = skipped
    print("\n".join(_report(out)))
    if skipped:
        print(f"skipped (package not installed): {', '.join(skipped)}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
