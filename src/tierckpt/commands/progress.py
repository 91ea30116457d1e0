"""Progress of long commands (verify, promote, export, gc): a bar on a terminal, lines otherwise.

On a terminal the bar is tqdm's (imported only then; without tqdm installed, plain lines).
Elsewhere (a log file, CI, a pipe) one line goes out per tenth of the work, so a log shows
that the command moves without a line per item. Everything goes to stderr: stdout holds the
command's result, which scripts parse.

Call order: ``with Progress("verify", total=n, unit="B") as bar:`` → ``bar.update(k, "name")``
any number of times → leaving the block prints the final line.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Progress"]

#: "auto" (bar on a terminal, lines otherwise), "bar", "plain", "none"; the CLI sets it from --progress
MODE = "auto"


class Progress:
    """Counts work done out of ``total`` (bytes when ``unit == 'B'``, else items)."""

    def __init__(self, what: str, total: int, *, unit: str = "item", stream: TextIO | None = None) -> None:
        self.what = what
        self.total = max(0, total)
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self._t0 = time.perf_counter()
        self._last_tenth = -1
        self._bar: Any = None
        mode = MODE
        if mode == "auto":
            mode = "bar" if _isatty(self.stream) else "plain"
        self.mode = mode
        if mode == "bar":
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is the 'cli' extra; without it a terminal gets lines too
                self.mode = "plain"
            else:
                self._bar = tqdm(total=self.total, desc=what, unit=unit, unit_scale=unit == "B",
                                 unit_divisor=1024, file=self.stream, leave=True, dynamic_ncols=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close(ok=et is None)

    def update(self, n: int, detail: str = "") -> None:
        """``n`` more units done; ``detail`` names what was just finished (a file, a tensor)."""
        self.done += n
        if self._bar is not None:
            if detail:
                self._bar.set_postfix_str(detail, refresh=False)
            self._bar.update(n)
        elif self.mode == "plain":
            tenth = 10 if self.total == 0 else min(10, self.done * 10 // self.total)
            if tenth > self._last_tenth and self.done < self.total:
                self._last_tenth = tenth
                self._line(detail)

    def close(self, *, ok: bool = True) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.mode == "plain":
            self._line("done" if ok else "stopped")
        self.mode = "none"

    def _line(self, detail: str) -> None:
        pct = 100 if self.total == 0 else self.done * 100 // self.total
        elapsed = time.perf_counter() - self._t0
        amount = f"{_amount(self.done, self.unit)}/{_amount(self.total, self.unit)}"
        tail = f"  {detail}" if detail else ""
        print(f"{self.what}: {pct:3d}% {amount} {elapsed:.1f}s{tail}", file=self.stream, flush=True)


def _amount(n: int, unit: str) -> str:
    if unit != "B":
        return str(n)
    from tierckpt.commands.context import human

    return human(n)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
