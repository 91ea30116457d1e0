"""Follow the workers' output files (written by torch elastic's redirects) line by line."""

from __future__ import annotations

import os

__all__ = ["LineReader"]


class LineReader:
    """New complete lines of one growing file; the file may not exist yet."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._partial = b""

    def lines(self, max_bytes: int = 1 << 20) -> list[str]:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return []
        chunks = []
        total = 0
        while total < max_bytes:
            data = os.read(self._fd, 65536)
            if not data:
                break
            chunks.append(data)
            total += len(data)
        if not chunks:
            return []
        buf = self._partial + b"".join(chunks)
        *done, self._partial = buf.split(b"\n")
        if len(self._partial) > 65536:  # a line without end: evaluate what we have
            done.append(self._partial)
            self._partial = b""
        return [d.decode("utf-8", "replace").rstrip("\r") for d in done]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
