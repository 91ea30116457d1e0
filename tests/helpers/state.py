"""Deterministic state dicts: every value is a pure function of (key, step, rank).

A loader recomputes what a step must hold and compares bitwise (``torch.equal``), so a
test never needs the saving process to tell it what was saved. ``to_wire`` / ``from_wire``
move tensors between processes as plain bytes (no shared-memory handles that die with
the sender).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

__all__ = ["assert_state_equal", "from_wire", "seeded", "small_state", "to_wire", "zeros_like_state"]


def seeded(key: str, step: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor that depends only on ``key``, ``step``, ``shape`` and ``dtype``."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}@{step}".encode()))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int64).to(dtype)


def small_state(step: int, rank: int) -> dict[str, Any]:
    """A few hundred KiB per rank: replicated and rank-private tensors of several dtypes."""
    return {
        "model": {
            "w": seeded("model.w", step, (64, 256)),
            "b": seeded("model.b", step, (256,), torch.bfloat16),
        },
        f"rank{rank}": {"opt": seeded(f"rank{rank}.opt", step, (128, 100)), "ids": seeded(f"rank{rank}.ids", step, (333,), torch.int64)},
        "step": step,
    }


def zeros_like_state(sd: Any) -> Any:
    """Same structure, every tensor zero-filled and ints set to -1 (so a load must fill them)."""
    if isinstance(sd, dict):
        return {k: zeros_like_state(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, int):
        return -1
    return sd


def to_wire(sd: Any) -> Any:
    if isinstance(sd, dict):
        return {k: to_wire(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        t = sd.detach().contiguous()
        return ("tensor", str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return sd


def from_wire(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: from_wire(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == "tensor":
        _, dtype, shape, raw = obj
        dt = getattr(torch, dtype)
        if not raw:
            return torch.empty(shape, dtype=dt)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape)
    return obj


def assert_state_equal(actual: Any, expected: Any, where: str = "") -> None:
    """Same keys, same non-tensor values, tensors bitwise equal with the same dtype and shape."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and sorted(actual) == sorted(expected), (where, sorted(actual), sorted(expected))
        for k in expected:
            assert_state_equal(actual[k], expected[k], f"{where}.{k}" if where else k)
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), (where, type(actual))
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, (where, actual.dtype, actual.shape)
        assert torch.equal(actual, expected), f"{where}: tensor differs from the expected value"
    else:
        assert actual == expected, (where, actual, expected)
