"""Delay every packet of one netfilter queue by a fixed time: a userspace stand-in for ``tc netem delay``.

Run by ``netfault`` in the cluster bridge's network namespace (never by hand), standard library only:

    python -I nfqdelay.py QUEUE_NUM DELAY_MS      # stdin: a pipe from the harness

It binds netfilter queue ``QUEUE_NUM`` over a raw ``NETLINK_NETFILTER`` socket (the
nfnetlink_queue protocol of ``linux/netfilter/nfnetlink_queue.h``), asks for metadata only
(no payload is copied), prints ``ready`` and then, for each queued packet, waits until its
arrival + ``DELAY_MS`` and gives it an ``NF_ACCEPT`` verdict. The delay is the same for every
packet, so due order is arrival order (the kernel's packet ids): one batch verdict ("every id up
to N") accepts all packets that are due. An ``iptables ... -j NFQUEUE --queue-num QUEUE_NUM
--queue-bypass`` rule sends the packets here.

It never drops: the queue is bound fail-open (a full queue or a full socket buffer lets the
packet through undelayed), a packet whose id it cannot read is covered by the next batch verdict,
and on its way out it accepts everything it holds. It exits when stdin reaches end of file (the
harness closed the pipe, or the harness is gone) or on SIGTERM; then ``--queue-bypass`` lets
packets pass undelayed. At exit it prints one JSON line of counts on stdout.
"""

from __future__ import annotations

import collections
import json
import os
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NLMSG_ERROR = 2
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND, NFQNL_CFG_CMD_UNBIND = 1, 2
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO = 0x1, 0x4
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NF_ACCEPT = 1
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER
QUEUE_MAXLEN = 16384
RCVBUF = 8 << 20

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, portid (host order)
_NFGENMSG = struct.Struct("!BBH")  # family, version, res_id (big endian)
_NLATTR = struct.Struct("=HH")  # len, type


def _attr(kind: int, payload: bytes) -> bytes:
    pad = b"\0" * (-len(payload) % 4)
    return _NLATTR.pack(_NLATTR.size + len(payload), kind) + payload + pad


def _message(msg: int, queue: int, attrs: bytes, seq: int, flags: int = NLM_F_REQUEST) -> bytes:
    body = _NFGENMSG.pack(socket.AF_UNSPEC, 0, queue) + attrs
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, flags, seq, 0) + body


def _messages(data: bytes) -> list[tuple[int, int, bytes]]:
    """(type, sequence number, payload after the netlink header) of each netlink message in one datagram."""
    out, off = [], 0
    while off + _NLMSGHDR.size <= len(data):
        length, kind, _flags, seq, _pid = _NLMSGHDR.unpack_from(data, off)
        if length < _NLMSGHDR.size or off + length > len(data):
            break
        out.append((kind, seq, data[off + _NLMSGHDR.size:off + length]))
        off += (length + 3) & ~3
    return out


def packet_id(payload: bytes) -> int | None:
    """The packet id in an NFQNL_MSG_PACKET payload (nfgenmsg, then attributes), None if absent."""
    off = _NFGENMSG.size
    while off + _NLATTR.size <= len(payload):
        length, kind = _NLATTR.unpack_from(payload, off)
        if length < _NLATTR.size:
            return None
        if kind & NLA_TYPE_MASK == NFQA_PACKET_HDR and length >= _NLATTR.size + 4:
            return int(struct.unpack_from("!I", payload, off + _NLATTR.size)[0])
        off += (length + 3) & ~3
    return None


class Delayer:
    """One bound queue. Call order: ``Delayer(queue, delay_s)`` (binds, raises OSError if the
    kernel refuses) → ``run(stop_fd)`` until ``stop_fd`` is readable at EOF or SIGTERM → ``close()``."""

    def __init__(self, queue: int, delay_s: float) -> None:
        self.queue = queue
        self.delay_s = delay_s
        self.held: collections.deque[tuple[float, int]] = collections.deque()  # (due, packet id)
        self.counts = {"queued": 0, "accepted": 0, "unparsed": 0, "verdict_errors": 0, "max_held": 0}
        self.top_id = -1  # the highest packet id seen: accepting up to it releases everything
        self.seq = 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, 33, RCVBUF)  # SO_RCVBUFFORCE (root)
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
        self.sock.bind((0, 0))
        flags = struct.pack("!I", NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO)
        self._config(_attr(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, socket.AF_UNSPEC)))
        self._config(_attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)))
        self._config(_attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN)))
        self._config(_attr(NFQA_CFG_MASK, flags) + _attr(NFQA_CFG_FLAGS, flags))

    def _config(self, attrs: bytes) -> None:
        """Send one config message and wait for its acknowledgement (OSError with the kernel's errno)."""
        self.seq += 1
        self.sock.send(_message(NFQNL_MSG_CONFIG, self.queue, attrs, self.seq, NLM_F_REQUEST | NLM_F_ACK))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for kind, seq, payload in _messages(self.sock.recv(1 << 16)):
                if kind == NLMSG_ERROR and seq == self.seq:  # its acknowledgement, not a verdict's error
                    err = -struct.unpack_from("=i", payload)[0]
                    if err:
                        raise OSError(err, f"nfnetlink_queue config for queue {self.queue}: {os.strerror(err)}")
                    return
        raise OSError(f"no acknowledgement from nfnetlink_queue for queue {self.queue}")

    def _accept_up_to(self, last_id: int) -> None:
        attrs = _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, last_id))
        self.sock.send(_message(NFQNL_MSG_VERDICT_BATCH, self.queue, attrs, 0))

    def _receive(self) -> None:
        now = time.monotonic()
        while True:
            try:
                data = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            for kind, _seq, payload in _messages(data):
                if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                    pid = packet_id(payload)
                    if pid is None:  # cannot hold what it cannot name; the next batch verdict covers it
                        self.counts["unparsed"] += 1
                        continue
                    self.held.append((now + self.delay_s, pid))
                    self.top_id = max(self.top_id, pid)
                    self.counts["queued"] += 1
                elif kind == NLMSG_ERROR and struct.unpack_from("=i", payload)[0]:
                    self.counts["verdict_errors"] += 1
            self.counts["max_held"] = max(self.counts["max_held"], len(self.held))

    def _release_due(self) -> None:
        now, last = time.monotonic(), None
        while self.held and self.held[0][0] <= now:
            last = self.held.popleft()[1]
            self.counts["accepted"] += 1
        if last is not None:
            self._accept_up_to(last)

    def run(self, stop_fd: int) -> None:
        stopping = False

        def stop(_sig: int, _frame: object) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGTERM, stop)
        watch = [self.sock, stop_fd]
        while not stopping:
            timeout = max(0.0, self.held[0][0] - time.monotonic()) if self.held else 1.0
            try:
                ready, _, _ = select.select(watch, [], [], timeout)
            except InterruptedError:
                continue
            if self.sock in ready:
                self._receive()
            if stop_fd in ready and not os.read(stop_fd, 4096):
                break
            self._release_due()

    def close(self) -> None:
        """Accept everything held (and anything queued since), unbind, close."""
        try:
            self._receive()
            # ids are compared modulo 2**32 (nfq_id_after): "up to the newest + 2**30" also covers
            # packets queued after the last read, which the unbind would otherwise flush as drops
            self._accept_up_to((max(self.top_id, 0) + (1 << 30)) & 0xFFFFFFFF)
            self.counts["accepted"] += len(self.held)
            self.held.clear()
            self._config(_attr(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_UNBIND, 0, socket.AF_UNSPEC)))
        finally:
            self.sock.close()


def main() -> None:
    queue, delay_ms = int(sys.argv[1]), float(sys.argv[2])
    delayer = Delayer(queue, delay_ms / 1000)
    print("ready", flush=True)
    try:
        delayer.run(sys.stdin.fileno())
    finally:
        delayer.close()
        print(json.dumps(delayer.counts), flush=True)


if __name__ == "__main__":
    main()
