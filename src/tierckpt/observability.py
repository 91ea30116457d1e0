"""Logging in the seed's shape: ``[Rank r] Step s: <what> in <t>s (<MB/s>)``.

Records go to the ``tierckpt`` logger (and its children), and also to the config's
user logger when one is given. The library writes no file itself: handlers are the application's.
``namespace_log(namespace, directory)`` is the one file handler tierckpt offers, the seed's
per-namespace log (``<directory>/<namespace>_checkpointing.log``, the seed's directory being
``/var/log/sagemaker_checkpointing``); ``tierckpt run --checkpointing-log-dir`` attaches it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["SEED_LOG_DIR", "StepLogger", "get_logger", "namespace_log", "throughput"]

ROOT = "tierckpt"
#: where the seed's library writes its per-namespace log (documented; tierckpt writes none by default)
SEED_LOG_DIR = "/var/log/sagemaker_checkpointing"


def namespace_log(namespace: str, directory: str) -> logging.Handler:
    """A handler on ``<directory>/<namespace>_checkpointing.log`` (the folder is created) with the seed's
    format ``[time] [namespace] [logger] [LEVEL] [file:line] message``, at INFO. The caller adds it to
    the ``tierckpt`` logger (whose level it lowers to INFO if it was higher) and removes and closes it.
    An unwritable folder raises ``OSError`` (the launcher checks it before it starts)."""
    import os

    os.makedirs(directory, exist_ok=True)
    handler = logging.FileHandler(os.path.join(directory, f"{namespace}_checkpointing.log"), encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(
        f"[%(asctime)s] [{namespace}] [%(name)s] [%(levelname)s] [%(filename)s:%(lineno)d] %(message)s"))
    return handler


def get_logger(component: str) -> logging.Logger:
    return logging.getLogger(f"{ROOT}.{component}")


def throughput(nbytes: int, seconds: float) -> str:
    mbps = nbytes / 1e6 / seconds if seconds > 0 else float("inf")
    return f"{seconds:.3f}s ({nbytes / 1e6:.1f} MB, {mbps:.1f} MB/s)"


class StepLogger:
    """Prefixes records with rank and step and fans them out to the user logger too."""

    def __init__(self, component: str, rank: int, user: logging.Logger | None = None) -> None:
        self.logger = get_logger(component)
        self.rank = rank
        self.user = user

    def log(self, level: int, step: int | None, msg: str, *args: object) -> None:
        prefix = f"[Rank {self.rank}] Step {step}: " if step is not None else f"[Rank {self.rank}] "
        self.logger.log(level, prefix + msg, *args, stacklevel=2)
        if self.user is not None and self.user is not self.logger:
            self.user.log(level, prefix + msg, *args, stacklevel=2)

    def info(self, step: int | None, msg: str, *args: object) -> None:
        self.log(logging.INFO, step, msg, *args)

    def warning(self, step: int | None, msg: str, *args: object) -> None:
        self.log(logging.WARNING, step, msg, *args)

    def debug(self, step: int | None, msg: str, *args: object) -> None:
        self.log(logging.DEBUG, step, msg, *args)

    @contextmanager
    def timed(self, step: int | None, what: str, nbytes: int = 0) -> Iterator[None]:
        """Log ``<what> completed in <t>s (<MB/s>)`` when the block finishes without error."""
        t0 = time.perf_counter()
        yield
        dt = time.perf_counter() - t0
        if nbytes:
            self.info(step, "%s completed in %s", what, throughput(nbytes, dt))
        else:
            self.info(step, "%s completed in %.3fs", what, dt)
