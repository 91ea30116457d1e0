"""promote: a memory step becomes a verified durable step that loads with no memory tier at all."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import torch

from tierckpt import Checkpointer

from .conftest import data_offset_of, flip_byte, model_state


def _zeros(sd):  # type: ignore[no-untyped-def]
    if isinstance(sd, dict):
        return {k: _zeros(v) for k, v in sd.items()}
    return torch.zeros_like(sd) if isinstance(sd, torch.Tensor) else None


def _assert_bitwise(a, b) -> None:  # type: ignore[no-untyped-def]
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_bitwise(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    else:
        assert a == b


def test_promote_copies_verifies_and_the_copy_loads_alone(store, cli) -> None:  # type: ignore[no-untyped-def]
    store.save(5, 6)  # memory only
    assert not store.durable_step(6).exists()
    r = cli(*store.argv(), "promote", "6")
    assert r.rc == 0, r.err
    assert re.fullmatch(rf"step 6 promoted: [\d.]+ KiB verified at {store.durable_step(6)}\n", r.out)
    assert "promote step 6: 100%" in r.err and r.err.rstrip().endswith("done")
    assert (store.durable_step(6) / "COMMITTED").is_file() and not store.durable_step(5).exists()
    assert cli(*store.argv(), "verify", "6").rc == 0
    with tempfile.TemporaryDirectory(dir="/dev/shm") as empty:  # a fresh node: only the durable copy is there
        with Checkpointer(store.config(memory_dir=empty)) as ck:
            target = _zeros(model_state(6))
            target["lr"], target["epoch"] = None, None
            assert ck.load(target) == 6
            assert ck.last_load["tiers"] == ["durable"] or set(ck.last_load["tiers"]) == {"durable"}
    _assert_bitwise(target, model_state(6))
    again = cli(*store.argv(), "promote", "6")
    assert again.rc == 0 and again.out == f"step 6 is durable already: {store.durable_step(6)}\n"


def test_a_corrupt_memory_copy_is_never_made_durable(store, cli) -> None:  # type: ignore[no-untyped-def]
    store.save(2)
    flip_byte(store.memory_step(2) / "__0_0.distcp", data_offset_of(store.memory_step(2)))
    r = cli(*store.argv(), "promote", "2")
    assert r.rc == 4 and "fails its checksum" in r.err
    assert not store.durable_step(2).exists()
    assert re.search(r"^durable\s+-\s+\(empty\)", cli(*store.argv(), "ls").out, re.M)
    assert not (store.durable_dir / "run1" / ".staging").exists() or not any((store.durable_dir / "run1" / ".staging").iterdir())


def test_promote_needs_a_durable_tier_and_a_memory_step(store, cli) -> None:  # type: ignore[no-untyped-def]
    store.save(1)
    no_durable = cli(*store.argv(durable=False), "promote", "1")
    assert no_durable.rc == 2 and "promote needs a durable tier" in no_durable.err
    missing = cli(*store.argv(), "promote", "4")
    assert missing.rc == 3 and "step 4 of 'run1' is not committed in the memory tier" in missing.err
    assert "(committed there: 1)" in missing.err
    assert not Path(store.durable_dir, "run1", "step_4").exists()
