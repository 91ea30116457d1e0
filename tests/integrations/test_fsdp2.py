"""FSDP2 (``fully_shard``) in a plain loop: saved by 2 gloo ranks, resumed by 1 and by 3.

Real processes through tests/helpers/dist.py, the loop of examples/fsdp2_train.py. The resumed
state (model and AdamW state, gathered unsharded) must equal, bit for bit, the state the 2 ranks
held when they saved: once resharded onto 1 rank from the memory tier, once onto 3 ranks from
the durable tier alone (a fresh memory root, as after losing the node).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_ranks

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")


def _train(rank: int, memory_dir: str, durable_url: str, steps: int) -> dict[str, Any]:
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import fsdp2_train

    import tierckpt

    cfg = tierckpt.CheckpointConfig(namespace="fsdp2", memory_dir=memory_dir, durable_url=durable_url,
                                    durable_every_n_steps=1)
    out = fsdp2_train.run(cfg, steps)
    if rank != 0:
        return {"resumed": out["resumed"]}
    buf = io.BytesIO()  # tensors through the pipe would travel as fds of a process about to exit
    torch.save(out, buf)
    return {"resumed": out["resumed"], "blob": buf.getvalue()}


def _decode(result: dict[str, Any]) -> dict[str, Any]:
    return torch.load(io.BytesIO(result["blob"]), weights_only=False)


def _assert_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.slow
def test_fsdp2_saved_on_2_ranks_reshards_to_1_and_3(shm_root: Path, durable_dir: Path) -> None:
    url = f"file://{durable_dir}"
    two = run_ranks(_train, 2, str(shm_root / "a"), url, 4, timeout=120)
    assert [r["resumed"] for r in two] == [None, None]
    saved = _decode(two[0])["final"]  # after step 3, the newest step saved
    assert any(v.abs().sum() > 0 for v in saved["optim"]["state"]["0.weight"].values() if v.dim())

    one = _decode(run_ranks(_train, 1, str(shm_root / "a"), url, 4, timeout=120)[0])
    assert one["resumed"] == 3 and one["tiers"] == ["memory"]
    _assert_equal(one["at_resume"], saved, "2->1")

    three = run_ranks(_train, 3, str(shm_root / "fresh"), url, 6, timeout=150)
    assert [r["resumed"] for r in three] == [3, 3, 3]
    first = _decode(three[0])
    assert first["tiers"] == ["durable"]
    _assert_equal(first["at_resume"], saved, "2->3")
    assert not torch.equal(first["final"]["model"]["0.weight"], saved["model"]["0.weight"])  # trained on
