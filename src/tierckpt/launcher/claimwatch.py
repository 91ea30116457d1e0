"""Another node's fault claim, pushed by the store instead of read every monitor tick.

The agent's monitor loop used to read generation g's claim key once per tick (0.1 s): ten store
operations per node per second, whatever happened, the largest part of the control plane's
steady-state traffic (1024 nodes: ~10 000 of ~14 000 operations a second on the store host).
Here one thread per agent blocks in the store's ``wait`` on the key every claimer sets after its
claim (``JobControl.wait_claim``); the store wakes it, it wakes the monitor loop, and the loop
reads the claim at once. The loop still reads the key every ``safety_poll_s`` (1 s): a claimer
killed between its ``compare_set`` and its ``set`` leaves no wake-up key, and a watch whose
store connection failed is replaced by those reads.

Call order (the agent):

    watch = ClaimWatch(connect, notify)   # connect(): a new store client; notify(): wake the loop
    ...every tick: watch.follow(g)        # a no-op until the generation changes
                   if watch.due(g): rec = ctl.claimed(g)
    watch.close()                         # the thread ends at its next wake-up (daemon meanwhile)

The watch waits without a timeout of its own (``wait_s``, a day): a timed-out TCPStore wait
prints a c10d warning, and a thread that woke every minute on every node would fill the logs.
A generation that ends without a claim of it leaves the thread blocked on the old key; the
next ``follow`` starts a new thread with a new client and the old one is left to its wait.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from tierckpt.launcher.control import JobControl

__all__ = ["ClaimWatch"]


class ClaimWatch:
    def __init__(self, connect: Callable[[], Any], notify: Callable[[], None], *, safety_poll_s: float = 1.0,
                 wait_s: float = 86400.0) -> None:
        self._connect = connect
        self._notify = notify
        self.safety_poll_s = safety_poll_s
        self._wait_s = wait_s
        self._lock = threading.Condition()  # notified when the followed generation changes or it closes
        self._generation: int | None = None  # the generation followed now
        self._waiting: int | None = None  # the generation the thread is blocked on
        self._claimed: set[int] = set()  # generations whose wake-up key the store reported
        self._broken = False  # the store connection failed: the loop reads every tick
        self._last_read = 0.0
        self._closed = False
        self._thread: threading.Thread | None = None
        #: generations the store woke this watch for (tests and ``bench scale`` read it)
        self.wakes = 0

    def follow(self, generation: int) -> None:
        """Watch ``generation``'s claim from now on (the first read is due at once)."""
        with self._lock:
            if self._generation == generation:
                return  # followed already: every tick may call this
            self._generation = generation
            self._last_read = 0.0
            self._lock.notify_all()
            if self._closed or self._broken:
                return
            if self._thread is not None and self._thread.is_alive() and self._waiting is not None \
                    and self._waiting < generation and self._waiting not in self._claimed:
                self._thread = None  # blocked on a generation that ended unclaimed: leave it there
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tierckpt-claim-watch", daemon=True)
                self._thread.start()

    def due(self, generation: int) -> bool:
        """Read the claim key of ``generation`` now? True when the store reported a claim, when
        the watch cannot wait (its connection failed, or it follows another generation), or
        when ``safety_poll_s`` passed since the last read. A True answer counts as that read."""
        now = time.monotonic()
        with self._lock:
            if (generation in self._claimed or self._broken or self._generation != generation
                    or self._thread is None or now - self._last_read >= self.safety_poll_s):
                self._last_read = now
                return True
            return False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def _run(self) -> None:
        me = threading.current_thread()
        try:
            ctl = JobControl(self._connect())
        except Exception:  # the store is gone or refuses: the loop reads every tick instead
            self._fail(me)
            return
        while True:
            with self._lock:
                while not self._closed and self._thread is me and self._generation in self._claimed:
                    self._lock.wait()  # reported already: until the agent follows the next generation
                if self._closed or self._thread is not me or self._generation is None:
                    return
                g = self._generation
                self._waiting = g
            try:
                rec = ctl.wait_claim(g, self._wait_s)
            except Exception:
                self._fail(me)
                return
            if rec is None:  # a day without a claim: wait again
                continue
            with self._lock:
                self._claimed.add(g)
                self.wakes += 1
                if self._generation == g and self._thread is me:
                    self._last_read = 0.0
            self._notify()

    def _fail(self, me: threading.Thread) -> None:
        with self._lock:
            if self._thread is me:
                self._broken = True
