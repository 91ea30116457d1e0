"""export: the saved model as Hugging Face safetensors, loaded back with ``safetensors`` and compared bitwise."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.state import seeded

from .conftest import NS, data_offset_of, flip_byte, model_state

safetensors_torch = pytest.importorskip("safetensors.torch", reason="pip install 'tierckpt[export]'")


def _flat(sd: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k].contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), k


def _load_dir(out: Path) -> dict[str, torch.Tensor]:
    index = out / "model.safetensors.index.json"
    if not index.exists():
        return dict(safetensors_torch.load_file(out / "model.safetensors"))
    weight_map = json.loads(index.read_text())["weight_map"]
    loaded: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        part = safetensors_torch.load_file(out / file)
        assert all(weight_map[k] == file for k in part)  # the index says where each tensor is
        loaded |= part
    assert sorted(loaded) == sorted(weight_map)
    return loaded


def test_export_one_file_is_model_safetensors(store, cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store.save(3)
    out = tmp_path / "hf"
    r = cli(*store.argv(), "export", "3", "--to", str(out))
    assert r.rc == 0, r.err
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert "exported step 3 of 'run1' (metadata from the memory tier): 4 tensor(s)" in r.out
    assert "left out (not tensors): epoch, lr" in r.out
    assert "export step 3: 100%" in r.err
    _assert_bitwise(_load_dir(out), _flat(model_state(3)))
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt"  # what transformers checks before loading


def test_export_sharded_with_index_and_a_prefix(store, cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store.save(4, durable=(4,))
    out = tmp_path / "sharded"
    r = cli(*store.argv(), "export", "4", "--to", str(out), "--prefix", "model", "--max-shard-size", "1KiB")
    assert r.rc == 0, r.err
    names = sorted(p.name for p in out.iterdir())
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"embed.weight", "layer.0.bias", "layer.0.ids"}
    _assert_bitwise(_load_dir(out), model_state(4)["model"])
    assert "left out" not in r.out  # only the tensors under 'model' were asked for


def test_export_reads_around_a_corrupt_memory_copy(store, cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store.save(5, durable=(5,))
    flip_byte(store.memory_step(5) / "__0_0.distcp", data_offset_of(store.memory_step(5)))
    r = cli(*store.argv(), "export", "5", "--to", str(tmp_path / "out"))
    assert r.rc == 0, r.err
    _assert_bitwise(_load_dir(tmp_path / "out"), _flat(model_state(5)))
    alone = cli(*store.argv(durable=False), "export", "5", "--to", str(tmp_path / "out2"))
    assert alone.rc == 4 and "no good copy of __0_0.distcp" in alone.err and "fails its checksum" in alone.err
    assert not (tmp_path / "out2").exists() or not any((tmp_path / "out2").iterdir())


def test_export_refuses_a_non_empty_directory_and_a_missing_step(store, cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store.save(1)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    r = cli(*store.argv(), "export", "1", "--to", str(tmp_path / "full"))
    assert r.rc == 2 and "is not an empty directory" in r.err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    missing = cli(*store.argv(), "export", "9", "--to", str(tmp_path / "x"))
    assert missing.rc == 3 and not (tmp_path / "x").exists()
    with pytest.raises(SystemExit):
        cli(*store.argv(), "export", "1", "--to", str(tmp_path / "y"), "--max-shard-size", "lots")


# -- a model sharded over two ranks comes out whole ------------------------------------------
STEP = 11


def _full() -> dict[str, torch.Tensor]:
    return {"emb": seeded("emb", STEP, (10, 16)), "proj": seeded("proj", STEP, (6, 9), torch.bfloat16),
            "bias": seeded("bias", STEP, (16,))}


def _save_sharded(rank: int, memory_dir: str, durable_url: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import tierckpt

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = _full()
    sd = {"emb": distribute_tensor(full["emb"], mesh, [Shard(0)]), "proj": distribute_tensor(full["proj"], mesh, [Shard(1)]),
          "bias": full["bias"]}
    config = tierckpt.CheckpointConfig(namespace=NS, memory_dir=memory_dir, durable_url=durable_url)
    with tierckpt.Checkpointer(config) as ck:
        ck.save(STEP, sd, durable=True).result(60)


@pytest.mark.slow
def test_export_consolidates_shards_saved_by_two_ranks(store, cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    run_ranks(_save_sharded, 2, str(store.memory_dir), store.durable_url)
    shown = cli(*store.argv(), "show", str(STEP))
    assert re.search(r"emb\s+float32\s+\(10, 16\)\s+640  \(2 shards\)", shown.out)
    r = cli(*store.argv(), "export", str(STEP), "--to", str(tmp_path / "whole"))
    assert r.rc == 0, r.err
    _assert_bitwise(_load_dir(tmp_path / "whole"), _full())


def test_the_export_loads_through_dcps_hugging_face_reader(store, cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    store.save(6)
    out = tmp_path / "hf"
    assert cli(*store.argv(), "export", "6", "--to", str(out), "--prefix", "model", "--max-shard-size", "1KiB").rc == 0
    want = model_state(6)["model"]
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(target, storage_reader=HuggingFaceStorageReader(str(out)), no_dist=True)  # one process, no group
    _assert_bitwise(target, want)
