"""A worker that died of another's death: its crash is a symptom, not a cause.

When one rank crashes, its peers' collectives fail a moment later ("Connection reset by peer" from
gloo, an aborted NCCL communicator) and they exit non-zero too. Each node's agent sees its own
worker's exit; whichever claims first names the cause, so the healthy node was blamed whenever its
agent won the race (seen in CI under load: the offender policy counted the wrong node).

``peer_failure(text)`` reads the end of a failed worker's output for those messages; the agent
marks such a crash's record as a symptom, and ``decide/diagnose.py`` holds it for a short settle
window before it is claimed: the node whose worker really failed claims within milliseconds of its
SIGCHLD and the holding agent follows that claim; a silent or lost node is claimed instead. A
crash without such a line (an exception of its own, a signal, ``os._exit``) is claimed at once.

Call order: ``peer_failure(tail(path))`` on a failed worker's stderr, then its stdout.
"""

from __future__ import annotations

import os
import re

__all__ = ["peer_failure", "tail"]

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
