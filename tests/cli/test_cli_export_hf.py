"""export --format hf / torch: a training step's model as the files ``from_pretrained`` loads.

A real (tiny) transformers Llama is saved by a Checkpointer inside a training state, exported,
and loaded back with ``AutoModelForCausalLM.from_pretrained``, bitwise; without transformers the
same files are checked with safetensors and ``torch.load(weights_only=True)`` alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer

safetensors_torch = pytest.importorskip("safetensors.torch", reason="pip install 'tierckpt[export]'")

STEP = 7


def _tiny_llama() -> tuple[Any, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config), config.to_dict()


def _plain_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"embed_tokens.weight": torch.randn(64, 32, generator=g), "norm.weight": torch.ones(32).to(torch.bfloat16),
            "layers.0.mlp.up_proj.weight": torch.randn(64, 32, generator=g)}


def _save(store: Any, model_sd: dict[str, torch.Tensor]) -> None:
    state = {"model": model_sd, "optimizer": {"exp_avg": torch.zeros(3)}, "step": STEP}
    with Checkpointer(store.config()) as ck:
        ck.save(STEP, state).result(60)


def _bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k].contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), k


def test_hf_format_shards_under_model_with_index_and_config(store, cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    want = _plain_model()
    _save(store, want)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    out = tmp_path / "hf"
    r = cli(*store.argv(), "export", str(STEP), "--to", str(out), "--format", "hf", "--max-shard-size", "9KB",
            "--config", str(tmp_path / "config.json"))
    assert r.rc == 0, r.err
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json"]
    assert "the tensors under 'model', named without it" in r.out and "optimizer" not in r.out
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    got: dict[str, torch.Tensor] = {}
    for name in sorted(set(weight_map.values())):
        got |= safetensors_torch.load_file(out / name)
    _bitwise(got, want)


def test_torch_format_is_pytorch_model_bin_loaded_weights_only(store, cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    want = _plain_model()
    _save(store, want)
    out = tmp_path / "bin"
    assert cli(*store.argv(), "export", str(STEP), "--to", str(out), "--format", "torch").rc == 0
    assert sorted(p.name for p in out.iterdir()) == ["pytorch_model.bin"]
    _bitwise(torch.load(out / "pytorch_model.bin", weights_only=True), want)
    sharded = tmp_path / "bin2"
    assert cli(*store.argv(), "export", str(STEP), "--to", str(sharded), "--format", "torch", "--max-shard-size", "9KB").rc == 0
    index = json.loads((sharded / "pytorch_model.bin.index.json").read_text())
    got: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        got |= torch.load(sharded / name, weights_only=True)
    _bitwise(got, want)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())


def test_a_bad_config_is_refused_before_anything_is_written(store, cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _save(store, _plain_model())
    (tmp_path / "c.json").write_text("[1, 2]")
    r = cli(*store.argv(), "export", str(STEP), "--to", str(tmp_path / "o"), "--format", "hf", "--config", str(tmp_path / "c.json"))
    assert r.rc == 2 and "is not a JSON object" in r.err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("fmt", ["hf", "torch"])
def test_from_pretrained_loads_the_export_bitwise(store, cli, tmp_path: Path, fmt: str) -> None:  # type: ignore[no-untyped-def]
    model, config = _tiny_llama()
    from transformers import AutoModelForCausalLM

    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _save(store, want)
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / fmt
    r = cli(*store.argv(), "export", str(STEP), "--to", str(out), "--format", fmt, "--max-shard-size", "40KB",
            "--config", str(tmp_path / "config.json"))
    assert r.rc == 0, r.err
    loaded = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)
    _bitwise({k: v.detach() for k, v in loaded.state_dict().items()}, want)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(loaded(ids).logits, model(ids).logits)
