"""A plain socket copy between two harness hosts: the yardstick for a restore over the same link.

    python sockcopy.py recv PORT NBYTES          # prints "listening", then one JSON line when done
    python sockcopy.py send HOST PORT NBYTES     # prints {"seconds": connect → the receiver's ack}

The sender sends ``NBYTES`` from memory (``sendall`` of 4 MiB buffers); the receiver reads them
into one reused buffer (nothing written, nothing checked) and answers one byte; the sender's
time runs from ``connect`` to that byte, so it covers every byte crossing the link.
"""

from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 4 << 20


def recv(port: int, nbytes: int) -> None:
    with socket.create_server(("0.0.0.0", port)) as srv:
        print("listening", flush=True)
        conn, _ = srv.accept()
        with conn:
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            left = nbytes
            t0 = time.perf_counter()
            while left:
                k = conn.recv_into(view[: min(CHUNK, left)])
                if k == 0:
                    raise SystemExit(f"the sender closed with {left} bytes to come")
                left -= k
            conn.sendall(b"k")
            print(json.dumps({"bytes": nbytes, "seconds": time.perf_counter() - t0}), flush=True)


def send(host: str, port: int, nbytes: int) -> None:
    data = b"\x5a" * CHUNK
    t0 = time.perf_counter()
    with socket.create_connection((host, port), timeout=120) as s:
        left = nbytes
        while left:
            n = min(CHUNK, left)
            s.sendall(data[:n])
            left -= n
        if s.recv(1) != b"k":
            raise SystemExit("no acknowledgement from the receiver")
    print(json.dumps({"bytes": nbytes, "seconds": time.perf_counter() - t0}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        recv(int(sys.argv[2]), int(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
