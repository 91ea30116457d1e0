"""What ends the agent's wait between two polls early: a child process exited.

Call order (the agent's main thread): ``Waker()`` once; ``wait(interval)`` instead of
``time.sleep(interval)`` before each poll; ``notify()`` from any thread; ``close()`` at the end. A worker's death raises SIGCHLD, which Python's C-level handler turns
into a byte on the wakeup pipe (``signal.set_wakeup_fd``), so the agent polls at once instead
of at its next tick; nothing runs inside a signal handler. Off the main thread (where signals
cannot be set) it is a plain timed wait that ``notify`` still ends.
"""

from __future__ import annotations

import os
import select
import signal
import threading
from typing import Any

__all__ = ["Waker"]


class Waker:
    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._old_fd: int | None = None
        self._old_handler: Any = None
        if threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGCHLD, _ignore)
            signal.siginterrupt(signal.SIGCHLD, False)  # SA_RESTART: C code in the agent sees no EINTR
            self._old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``; True if woken early. Drains what woke it."""
        ready = select.select([self._r], [], [], timeout_s)[0]
        if ready:
            try:
                while os.read(self._r, 4096):
                    pass
            except BlockingIOError:
                pass
        return bool(ready)

    def notify(self) -> None:
        try:
            os.write(self._w, b"c")
        except (BlockingIOError, OSError):  # full (a wake-up is pending anyway) or closed
            pass

    def close(self) -> None:
        if self._old_fd is not None:
            signal.set_wakeup_fd(self._old_fd)
            signal.signal(signal.SIGCHLD, self._old_handler)
            self._old_fd = None
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


def _ignore(signum: int, frame: object) -> None:
    """SIGCHLD's Python handler: nothing; the wakeup fd carries the news (SIG_DFL would not)."""
