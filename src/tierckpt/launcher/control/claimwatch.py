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

    watch = ClaimWatch(connect, notify, release)  # connect(): a new store client; notify(): wake
                                                  # the loop; release(g): JobControl.release_claim_waiters
    ...every tick: watch.follow(g)        # a no-op until the generation changes
                   if watch.due(g): rec = ctl.claimed(g)
    watch.close()                         # releases its wait and joins the thread (2 s at most)

The watch waits without a timeout of its own (``wait_s``, a day): a timed-out TCPStore wait
prints a c10d warning, and a thread that woke every minute on every node would fill the logs.
Its wait must end before the interpreter does: a thread blocked in the C++ wait when the store
closes the connection during interpreter shutdown aborts the process (SIGABRT, seen in the
scenario tests: the agent had emitted its exit, code 0). So ``close`` sets the waited key with
no claim behind it (``release``), as ``follow`` does for a generation that ended unclaimed (the
one thread then moves on to the generation followed now).
Other agents' watches woken that way find no claim and read the claim key every tick for the
rest of that generation, as the loop did before there was a watch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from tierckpt.launcher.control.jobcontrol import JobControl

__all__ = ["ClaimWatch"]


class ClaimWatch:
    def __init__(self, connect: Callable[[], Any], notify: Callable[[], None],
                 release: Callable[[int], None] | None = None, *, safety_poll_s: float = 1.0,
                 wait_s: float = 86400.0) -> None:
        self._connect = connect
        self._notify = notify
        self._release = release
        self.safety_poll_s = safety_poll_s
        self._wait_s = wait_s
        self._lock = threading.Condition()  # notified when the followed generation changes or it closes
        self._generation: int | None = None  # the generation followed now
        self._waiting: int | None = None  # the generation the thread is blocked on
        self._claimed: set[int] = set()  # generations whose claim the store reported
        self._released: set[int] = set()  # woken with no claim: read every tick for the rest of it
        self._broken = False  # the store connection failed: the loop reads every tick
        self._last_read = 0.0
        self._closed = False
        self._thread: threading.Thread | None = None
        #: generations the store woke this watch for with a claim (tests and ``bench scale`` read it)
        self.wakes = 0

    def follow(self, generation: int) -> None:
        """Watch ``generation``'s claim from now on (the first read is due at once); a no-op for
        the generation followed already."""
        with self._lock:
            if self._generation == generation:
                return
            self._generation = generation
            self._last_read = 0.0
            self._lock.notify_all()  # a thread done with the old generation moves on to this one
            if self._closed or self._broken:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tierckpt-claim-watch", daemon=True)
                self._thread.start()
            stale = self._blocked_on()  # a generation that ended unclaimed: release its wait
        if stale is not None:
            self._release_in_background(stale)

    def due(self, generation: int) -> bool:
        """Read the claim key of ``generation`` now? True when the store reported a claim, when
        the watch cannot wait (its connection failed, it was released, or it follows another
        generation), or when ``safety_poll_s`` passed since the last read. True counts as that read."""
        now = time.monotonic()
        with self._lock:
            if (generation in self._claimed or generation in self._released or self._broken
                    or self._generation != generation or self._thread is None
                    or now - self._last_read >= self.safety_poll_s):
                self._last_read = now
                return True
            return False

    def close(self, timeout_s: float = 2.0) -> None:
        """End the watch: release the wait it is blocked in and join its thread (``timeout_s``)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            thread, blocked = self._thread, self._blocked_on()
        if thread is None:
            return
        deadline = time.monotonic() + timeout_s
        if blocked is not None:
            self._release_in_background(blocked).join(timeout_s)
        thread.join(max(0.0, deadline - time.monotonic()))

    def _blocked_on(self) -> int | None:
        """The generation the thread waits on in the store, if it does (under the lock)."""
        g = self._waiting
        return None if g is None or g in self._claimed or g in self._released else g

    def _release_in_background(self, generation: int) -> threading.Thread:
        """``release(generation)`` in a thread of its own: a store that does not answer holds up
        no caller (close joins it for a bounded time)."""
        def run() -> None:
            try:
                if self._release is not None:
                    self._release(generation)
            except Exception:  # the store is gone: so is the connection the wait was on
                pass

        t = threading.Thread(target=run, name="tierckpt-claim-release", daemon=True)
        t.start()
        return t

    def _run(self) -> None:
        """The watch's one thread: waits on the followed generation's wake-up key until closed."""
        try:
            ctl = JobControl(self._connect())
        except Exception:  # the store is gone or refuses: the loop reads every tick instead
            self._fail()
            return
        while True:
            with self._lock:
                while not self._closed and (self._generation in self._claimed or self._generation in self._released):
                    self._lock.wait()  # reported already: until the agent follows the next generation
                if self._closed or self._generation is None:
                    self._waiting = None
                    return
                g = self._generation
                self._waiting = g
            try:
                if not ctl.wait_claim_key(g, self._wait_s):
                    continue  # a day without a claim: wait again
                rec = ctl.claimed(g)
            except Exception:
                self._fail()
                return
            with self._lock:
                self._waiting = None
                if self._closed:
                    return
                if rec is None:  # released without a claim (an agent left, or the generation ended)
                    self._released.add(g)  # read every tick for the rest of it
                    continue
                self._claimed.add(g)
                self.wakes += 1
                if self._generation == g:
                    self._last_read = 0.0
            self._notify()

    def _fail(self) -> None:
        with self._lock:
            self._waiting = None
            self._broken = True
