"""A dataset of one file per sample on disk: what a real loader reads, for tests, the demo and benches.

``write_samples(directory, n, features=32, classes=8, seed=0)`` writes ``sample_<i>.bin`` files
(``features`` float32 values, then one int32 label), the same bytes for the same arguments, and
returns a ``FileDataset`` over them; ``FileDataset(directory)`` opens existing ones. Each
``__getitem__`` opens and reads its file (no cache of its own: the page cache is the system's),
returning ``(x, y)``: a float32 tensor of ``features`` and an int64 scalar.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import Dataset

__all__ = ["FileDataset", "write_samples"]


class FileDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, directory: str | os.PathLike[str], *, features: int = 32) -> None:
        self.directory = Path(directory)
        self.features = features
        self.files = sorted(p.name for p in self.directory.glob("sample_*.bin"))
        if not self.files:
            raise FileNotFoundError(f"no sample_*.bin files in {self.directory}: write them with write_samples")

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        raw = (self.directory / self.files[index]).read_bytes()
        x = torch.frombuffer(bytearray(raw[: 4 * self.features]), dtype=torch.float32)
        y = torch.frombuffer(bytearray(raw[4 * self.features :]), dtype=torch.int32)[0].to(torch.int64)
        return x, y


def write_samples(directory: str | os.PathLike[str], n: int, *, features: int = 32, classes: int = 8,
                  seed: int = 0) -> FileDataset:
    """Write ``n`` samples (atomically each: a reader never sees half a file) and open them."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = torch.randint(0, classes, (n,), generator=g, dtype=torch.int32)
    for i in range(n):
        path = out / f"sample_{i:06d}.bin"
        tmp = out / f".sample_{i:06d}.{os.getpid()}.tmp"
        tmp.write_bytes(x[i].numpy().tobytes() + y[i : i + 1].numpy().tobytes())
        os.replace(tmp, path)
    return FileDataset(out, features=features)
