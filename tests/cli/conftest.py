"""Fixtures for the CLI tests: steps saved by a real Checkpointer, and a way to run the command.

``cli`` runs ``tierckpt.cli.main`` in this process (argv as a user types it) and returns the
exit code with what went to stdout and stderr; progress is plain lines there, as in a log.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import CheckpointConfig, Checkpointer

NS = "run1"


def model_state(step: int) -> dict[str, Any]:
    """A small training state: model tensors of several dtypes, an optimizer tensor, plain objects."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "embed.weight": torch.randn(32, 16, generator=g),
            "layer.0.bias": torch.randn(16, generator=g).to(torch.bfloat16),
            "layer.0.ids": torch.randint(0, 1000, (7,), generator=g, dtype=torch.int64),
        },
        "optim": {"exp_avg": torch.randn(32, 16, generator=g).to(torch.float16)},
        "lr": 0.01 * step,
        "epoch": step // 10,
    }


@dataclass
class Result:
    rc: int
    out: str
    err: str


@dataclass
class Store:
    """A namespace with a memory tier on /dev/shm and a file:// durable tier."""

    memory_dir: Path
    durable_dir: Path

    @property
    def durable_url(self) -> str:
        return f"file://{self.durable_dir}"

    def config(self, **changes: Any) -> CheckpointConfig:
        fields: dict[str, Any] = {"namespace": NS, "memory_dir": str(self.memory_dir), "durable_url": self.durable_url,
                                  "durable_every_n_steps": 0}
        return CheckpointConfig(**(fields | changes))

    def argv(self, *, durable: bool = True) -> list[str]:
        out = ["--namespace", NS, "--memory-dir", str(self.memory_dir)]
        return out + (["--durable-url", self.durable_url] if durable else [])

    def save(self, *steps: int, durable: tuple[int, ...] = ()) -> None:
        with Checkpointer(self.config(memory_steps_retained=max(2, len(steps)))) as ck:
            for step in steps:
                ck.save(step, model_state(step), durable=step in durable).result(60)

    def memory_step(self, step: int) -> Path:
        return self.memory_dir / NS / f"step_{step}"

    def durable_step(self, step: int) -> Path:
        return self.durable_dir / NS / f"step_{step}"


@pytest.fixture
def store(shm_root: Path, durable_dir: Path) -> Store:
    return Store(shm_root, durable_dir)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Result]:
    from tierckpt import cli as cli_module

    def run(*argv: str) -> Result:
        capsys.readouterr()
        rc = cli_module.main(list(argv))
        captured = capsys.readouterr()
        return Result(rc, captured.out, captured.err)

    return run


def flip_byte(path: Path, offset: int) -> None:
    """One byte off, same size, through a new inode (the memory tier's file is a shared slot)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    tmp = path.with_name(path.name + ".flip")
    tmp.write_bytes(bytes(data))
    tmp.replace(path)


def data_offset_of(step_dir: Path, file: str = "__0_0.distcp") -> int:
    """The offset of the first tensor byte in a data file (from the manifest), to flip a data byte."""
    from tierckpt.layout import Manifest

    manifest = Manifest.from_bytes((step_dir / "manifest.json").read_bytes())
    rec = next(r for r in manifest.items if r.file == file and r.data_offset >= 0)
    return rec.offset + rec.data_offset
