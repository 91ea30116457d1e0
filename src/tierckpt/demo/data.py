"""The demo's data pipeline (``--data DIR``): a dataset of files read through a shuffled
``ResumableLoader`` with worker processes, its position saved beside the model every step.

Built once per process, before the process group (``start``: the workers fork then, holding no
socket of the group, and warm up while the group forms and the state loads), so in-process restarts keep it and its workers; each generation's load
repositions it. ``--no-data-restore`` saves the position but never restores it (every restart
starts the data over at epoch 0: the control that shows a soak notices lost data state).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

from tierckpt.data import ResumableLoader, item
from tierckpt.testing.files import FileDataset

__all__ = ["DemoData"]


class DemoData:
    def __init__(self, directory: str, *, batch_size: int, workers: int, restore: bool) -> None:
        # the process group does not exist yet (tierckpt.resilient makes it per generation)
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.loader = ResumableLoader(FileDataset(directory), batch_size=batch_size, seed=0, shuffle=True,
                                      rank=rank, world_size=world, num_workers=workers)
        self.loader.start()
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
