"""Rendezvous progress instead of silence: ``waiting for nodes at HOST:PORT: 1 of 2 joined``.

Call order (the agent, around each rendezvous round, which blocks in torch):

    with RendezvousProgress(handler):
        handler.next_rendezvous()

A daemon thread prints the line on stderr ``first_after_s`` after the round began and every
``every_s`` after that, until the block ends. The count comes from the handler (torch_rdzv.joined: ours reads one
counter; torch's dynamic (c10d) state is re-read by the waiting main thread about once a second,
and this thread only reads it): on a torch without those private fields (or the static backend)
the line says how many nodes are needed without the count (the fallback: tests/unit/launcher/test_right_by_default.py; the
count from torch: tests/launcher/test_right_by_default.py).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, TextIO, TypeVar

from tierckpt.launcher.membership import torch_rdzv

__all__ = ["RendezvousProgress", "WhileBlocked", "joined", "where"]


def joined(handler: Any) -> tuple[int | None, int | None]:
    """(nodes in the current round so far, nodes needed), or Nones (torch_rdzv.py)."""
    return torch_rdzv.joined(handler)


def where(handler: Any, fallback: str) -> str:
    """HOST:PORT of the rendezvous store (``fallback`` when it cannot be read)."""
    store = torch_rdzv.store_of(handler)
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f"{host}:{port}" if host and port else fallback


_W = TypeVar("_W", bound="WhileBlocked")


class WhileBlocked:
    """A daemon thread running ``_run`` while a ``with`` block (torch's blocking rendezvous) runs;
    ``_run`` polls ``self._done`` and returns when it is set. Subclasses set ``thread_name``."""

    thread_name = "tierckpt-rdzv-watch"

    def __init__(self) -> None:
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        raise NotImplementedError

    def __enter__(self: _W) -> _W:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)


class RendezvousProgress(WhileBlocked):
    """Prints rendezvous progress while the ``with`` block runs; see the module doc."""

    thread_name = "tierckpt-rdzv-progress"

    def __init__(self, handler: Any, endpoint: str, *, first_after_s: float = 2.0, every_s: float = 5.0,
                 out: TextIO | None = None) -> None:
        self.handler = handler
        self.endpoint = endpoint
        self.first_after_s = first_after_s
        self.every_s = every_s
        self.out = out if out is not None else sys.stderr
        super().__init__()

    def line(self) -> str:
        count, needed = joined(self.handler)
        at = where(self.handler, self.endpoint)
        if count is not None and needed is not None:
            return f"tierckpt run: waiting for nodes at {at}: {count} of {needed} joined"
        return f"tierckpt run: waiting for nodes at {at}" + (f" ({needed} needed)" if needed else "")

    def _run(self) -> None:
        wait = self.first_after_s
        while not self._done.wait(wait):
            try:
                print(self.line(), file=self.out, flush=True)
            except (OSError, ValueError):  # the stream closed under us: stop quietly
                return
            wait = self.every_s
