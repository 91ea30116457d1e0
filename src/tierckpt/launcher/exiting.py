"""Leave the process with a decided exit code, now: logs and standard streams flushed, then
``os._exit``, without the interpreter's finalization.

Two callers: ``tierckpt run`` as a program once it closed its parts (a store thread still blocked
in a wait could abort the finalization: SIGABRT, "terminate called without an active exception",
seen beside a CPU hog), and the supervisor when the job's store is lost (its liveness thread
decides while the main thread may be blocked in a call to the store for that client's timeout).
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["exit_now"]


def exit_now(code: int) -> None:
    """Flush and ``os._exit(code)``; callable from any thread."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
