"""The GPU staging path: pinned shared-memory slots and device-to-host copies on a side stream.

These run on a CUDA machine (the lent GPU machine); without CUDA they are skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tierckpt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_round_trip_and_pinned_slot(shm_root: Path) -> None:
    cfg = tierckpt.CheckpointConfig(namespace="gpu", memory_dir=str(shm_root))
    g = torch.Generator(device="cuda").manual_seed(0)
    sd = {"w": torch.randn(1024, 1024, device="cuda", generator=g), "b": torch.arange(10, device="cuda")}
    expected = {k: v.cpu() for k, v in sd.items()}
    with tierckpt.Checkpointer(cfg) as ck:
        ck.save(1, sd)
        assert ck.runtime.stager._pinned, "the slot was not registered as pinned memory"
        sd["w"].zero_()  # after save returns the GPU tensors may change
        ck.wait()
        out = {"w": torch.zeros(1024, 1024, device="cuda"), "b": torch.zeros(10, dtype=torch.int64, device="cuda")}
        assert ck.load(out) == 1
    assert torch.equal(out["w"].cpu(), expected["w"]) and torch.equal(out["b"].cpu(), expected["b"])


def test_save_waits_for_pending_kernels(shm_root: Path) -> None:
    cfg = tierckpt.CheckpointConfig(namespace="gpu2", memory_dir=str(shm_root))
    x = torch.ones(4096, 4096, device="cuda")
    for _ in range(20):
        x = x * 1.0001  # queued on the current stream: the copy must see the final value
    expected = x.cpu()
    with tierckpt.Checkpointer(cfg) as ck:
        ck.save(1, {"x": x})
        ck.wait()
        out = {"x": torch.zeros(4096, 4096)}
        ck.load(out)
    assert torch.equal(out["x"], expected)
