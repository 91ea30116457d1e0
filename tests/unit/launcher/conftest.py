"""A real TCPStore on 127.0.0.1 for the launcher's store-backed unit tests (spares, seats,
repeat offenders): ``server`` is the store host, ``client(server)`` one more client of it."""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from typing import Any

import pytest

# torch names both ends of every store connection with a reverse lookup that the resolver here
# drops now and then (5 s each, glibc's default; bench/scale.py quick_resolver): give up after 1 s
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


@pytest.fixture
def server() -> Iterator[Any]:
    import torch.distributed as dist

    yield dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,  # type: ignore[attr-defined]
                        timeout=datetime.timedelta(seconds=10))


def client(server: Any) -> Any:
    """A new client of ``server`` (each agent or thread of a test has its own, as in a job)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", server.port, is_master=False,  # type: ignore[attr-defined]
                         timeout=datetime.timedelta(seconds=10))
