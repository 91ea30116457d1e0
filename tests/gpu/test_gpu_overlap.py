"""Overlapped saves of CUDA tensors: side-stream copies into the pinned slot, fenced by the optimizer.

These run on a CUDA machine (the lent GPU machine); without CUDA they are skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt.errors import SnapshotChangedError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _cfg(shm_root: Path, ns: str) -> tierckpt.CheckpointConfig:
    return tierckpt.CheckpointConfig(namespace=ns, memory_dir=str(shm_root))


def test_overlapped_save_fenced_by_the_optimizer(shm_root: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 16)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tierckpt.Checkpointer(_cfg(shm_root, "gpu-ov")) as ck:
        ck.register_fence(opt)
        for step in range(1, 4):
            model(torch.randn(64, 1024, device="cuda")).tanh().sum().backward()
            expected = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            handle = ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}, overlap=True,
                             check_snapshot=True)
            opt.step()  # its kernels wait for the side-stream copy; the host does not
            opt.zero_grad()
        handle.wait()
        assert ck.runtime.stager._pinned, "the slot was not registered as pinned memory"
        assert not torch.equal(model[0].weight.detach().cpu(), expected["0.weight"])
        out = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}, "optim": opt.state_dict()}
        assert ck.load(out) == 3
    assert all(torch.equal(out["model"][k].cpu(), expected[k]) for k in expected)


def test_overlapped_copy_sees_kernels_queued_before_the_call(shm_root: Path) -> None:
    x = torch.ones(4096, 4096, device="cuda")
    for _ in range(20):
        x.mul_(1.0001)  # queued on the current stream: the copy must see the final value
    expected = x.cpu()
    with tierckpt.Checkpointer(_cfg(shm_root, "gpu-ov2")) as ck:
        handle = ck.save(1, {"x": x}, overlap=True)
        handle.wait_staged()
        x.zero_()
        ck.wait()
        out = {"x": torch.zeros(4096, 4096)}
        ck.load(out)
    assert torch.equal(out["x"], expected)


def test_debug_mode_catches_a_change_before_the_fence(shm_root: Path) -> None:
    x = torch.ones(1 << 20, device="cuda")
    with tierckpt.Checkpointer(_cfg(shm_root, "gpu-ov3")) as ck:
        ck.save(1, {"x": x}, overlap=True).wait()  # creates the side stream
        stream = ck.runtime.stager._stream
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1_000_000_000)  # holds the side stream back (about half a second)
        handle = ck.save(2, {"x": x}, overlap=True, check_snapshot=True)
        x.add_(1)  # misuse: the compute stream is not fenced, so this lands before the copy
        with pytest.raises(SnapshotChangedError, match="'x'"):
            handle.wait()
        with pytest.raises(SnapshotChangedError):
            ck.wait()
