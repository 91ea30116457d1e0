"""A worker that died of another's death: its crash is a symptom, not a cause.

When one rank crashes, its peers' collectives fail a moment later ("Connection reset by peer" from
gloo, an aborted NCCL communicator) and they exit non-zero too. Each node's agent sees its own
worker's exit; whichever claims first names the cause, so the healthy node was blamed whenever its
agent won the race (seen in CI under load: the offender policy counted the wrong node).

``peer_failure(text)`` reads the end of a failed worker's output for those messages. A crash that
shows one is *held* for a short settle window (``SETTLE_S``) before it is claimed: the node whose
worker really failed claims within milliseconds of its SIGCHLD, and the holding agent follows that
claim; a lost node found by liveness meanwhile is claimed instead. Only when nothing else explains
it within the window is the symptom claimed itself (``symptom`` names the line that showed it).
A crash without such a line (an exception of its own, a signal, ``os._exit``) is claimed at once.

Call order (the agent's loop, per generation): ``hold = SettleHold()`` at the start of each
generation; on every poll that finds a symptom crash, ``hold.hold(record, now)``: None while the
window lasts (keep polling the claims), then the first such record, to be claimed; a fault claimed
by anyone ends the generation and the hold with it.
"""

from __future__ import annotations

import os
import re
from typing import Any

__all__ = ["SETTLE_S", "SettleHold", "peer_failure", "tail"]

#: how long a symptom crash waits for the claim of its cause (a peer's crash arrives in ms; the
#: window bounds what a symptom without a cause adds to recovery)
SETTLE_S = 3.0

# the ways a collective or the workers' store reports a peer that went away (gloo, NCCL, c10d)
_PEER_GONE = re.compile(
    r"Connection reset by peer|Connection closed by peer|Broken pipe|"
    r"gloo/transport/.*(?:Read error|Write error|Socket closed)|"
    r"NCCL communicator was aborted|remote process exited|ncclRemoteError|"
    r"DistNetworkError|DistBackendError",
)
_TAIL_BYTES = 16384


def tail(path: str | os.PathLike[str] | None, size: int = _TAIL_BYTES) -> str:
    """The last ``size`` bytes of a worker's output file ("" when there is none)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def peer_failure(text: str) -> str | None:
    """The last line of ``text`` that shows a peer's failure (trimmed to 200 characters), or None."""
    for line in reversed(text.splitlines()):
        if _PEER_GONE.search(line):
            return line.strip()[:200]
    return None


class SettleHold:
    """The settle window of the symptom crash seen first in a generation."""

    def __init__(self, settle_s: float = SETTLE_S) -> None:
        self.settle_s = settle_s
        self.since: float | None = None
        self.first: dict[str, Any] | None = None

    def hold(self, record: dict[str, Any], now: float) -> dict[str, Any] | None:
        """None while the window since the first symptom lasts; then that first record (its
        detection time is the crash's), with ``settle_s`` the time it was held."""
        if self.first is None or self.since is None:
            self.since, self.first = now, record
        if now - self.since < self.settle_s:
            return None
        return {**self.first, "settle_s": round(now - self.since, 3)}
