"""The demo's data pipeline (``--data DIR``): a dataset of files read through a shuffled
``ResumableLoader`` with worker processes, its position saved beside the model every step.

Built once per process, before the process group (``start``: the workers fork then, holding no
socket of the group, and warm up while the group forms and the state loads), so in-process restarts keep it and its workers; each generation's load
repositions it. ``--no-data-restore`` saves the position but never restores it (every restart
starts the data over at epoch 0: the control that shows a soak notices lost data state).

``make_loader`` is the loader's factory (``tierckpt.data.ahead``): under ``tierckpt run
--warm-loader tierckpt.demo.data:make_loader`` each warm standby builds it ahead from the demo's
command line, so a restarted rank finds its workers forked and warm.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Iterator
from typing import Any

from tierckpt.data import ResumableLoader, ahead, item, prewarm
from tierckpt.testing.files import FileDataset

__all__ = ["DemoData"]


def make_loader(rank: int | None, world_size: int | None) -> ResumableLoader:
    """The demo's loader from its command line (``--data``, ``--batch-size``, ``--data-workers``);
    rank and world_size None in a warm standby (``tierckpt.data.prewarm``)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--data", required=True)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--data-workers", type=int, default=2)
    a, _ = p.parse_known_args(sys.argv[1:])
    return ResumableLoader(FileDataset(a.data), batch_size=a.batch_size, seed=0, shuffle=True, rank=rank,
                           world_size=world_size, num_workers=a.data_workers)


class DemoData:
    def __init__(self, *, restore: bool) -> None:
        # the process group does not exist yet (tierckpt.resilient makes it per generation): RANK, WORLD_SIZE
        self.loader = ahead(make_loader, rank=int(os.environ.get("RANK", "0")),
                            world_size=int(os.environ.get("WORLD_SIZE", "1")))
        report = prewarm.last()
        self.warm = bool(report and report.warm)  # the loader a warm standby built ahead (traced)
        self.item = item(self.loader)
        self.restore = restore

    def for_load(self) -> dict[str, Any]:
        """The entries a load restores: the loader's, unless ``--no-data-restore``."""
        return {"data": self.item} if self.restore else {}

    def for_save(self) -> dict[str, Any]:
        return {"data": self.item}

    def batches(self) -> Iterator[Any]:
        """Batches from the loader's position on, across epochs (repositions the workers)."""
        if not self.restore:  # as a loop that does not checkpoint its data: from the start, every time
            self.loader.sampler.seek(0, base=0, taken=0)
        return itertools.chain.from_iterable(iter(self.loader) for _ in itertools.count())
