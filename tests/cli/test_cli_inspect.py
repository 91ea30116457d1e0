"""ls, show and verify on steps saved by a real Checkpointer: output, exit codes, progress lines."""

from __future__ import annotations

import json
import re

from .conftest import NS, data_offset_of, flip_byte, model_state


def test_ls_shows_each_tier_and_state(store, cli) -> None:  # type: ignore[no-untyped-def]
    store.save(1, 2, durable=(1,))
    (store.durable_step(9)).mkdir(parents=True)  # a marker-less directory: partial
    r = cli(*store.argv(), "ls")
    assert r.rc == 0, r.err
    rows = [line.split() for line in r.out.splitlines()[2:]]
    assert [(row[0], row[1], row[2]) for row in rows] == [
        ("memory", "1", "committed"), ("memory", "2", "committed"), ("durable", "1", "committed"), ("durable", "9", "partial")]
    assert r.err == ""  # no verification: no progress


def test_ls_without_a_namespace_lists_the_namespaces(store, cli, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("TIERCKPT_NAMESPACE", raising=False)
    store.save(1, durable=(1,))
    (store.memory_dir / "other-run").mkdir()
    r = cli("ls", "--memory-dir", str(store.memory_dir), "--durable-url", store.durable_url)
    assert r.rc == 0
    assert re.search(rf"^{NS}\s+memory, durable$", r.out, re.M)
    assert re.search(r"^other-run\s+memory$", r.out, re.M)


def test_ls_of_an_unknown_namespace_says_so_and_names_the_ones_there(store, cli) -> None:  # type: ignore[no-untyped-def]
    store.save(1)
    r = cli("ls", "--namespace", "run2", "--memory-dir", str(store.memory_dir), "--durable-url", store.durable_url)
    assert r.rc == 3  # CheckpointNotFoundError
    assert "namespace 'run2' does not exist" in r.err and f"namespaces that exist: {NS}" in r.err
    assert r.out == ""


def test_ls_verify_marks_the_copy_that_fails_its_checksums(store, cli) -> None:  # type: ignore[no-untyped-def]
    store.save(1, 2, durable=(1, 2))
    good = cli(*store.argv(), "ls", "--verify")
    assert good.rc == 0 and good.out.count(" OK ") == 4
    assert "verify: 100%" in good.err and good.err.rstrip().endswith("done")
    target = store.durable_step(2) / "__0_0.distcp"
    flip_byte(target, data_offset_of(store.durable_step(2)))
    bad = cli(*store.argv(), "ls", "--verify")
    assert bad.rc == 4
    marks = {(row.split()[0], row.split()[1]): row.split()[6] for row in bad.out.splitlines()[2:6]}
    assert marks == {("memory", "1"): "OK", ("memory", "2"): "OK", ("durable", "1"): "OK", ("durable", "2"): "BAD"}
    assert "durable step 2:" in bad.out and "fails its checksum" in bad.out
    assert "1 committed copy fails verification: durable step 2" in bad.err


def test_verify_reports_each_tier_and_exits_4_on_a_bad_copy(store, cli) -> None:  # type: ignore[no-untyped-def]
    store.save(4, durable=(4,))
    r = cli(*store.argv(), "verify", "4")
    assert r.rc == 0
    assert re.search(r"^memory\s+step 4: OK", r.out, re.M) and re.search(r"^durable\s+step 4: OK", r.out, re.M)
    flip_byte(store.memory_step(4) / "__0_0.distcp", data_offset_of(store.memory_step(4)))
    r = cli(*store.argv(), "verify", "4")
    assert r.rc == 4
    assert re.search(r"^memory\s+step 4: BAD", r.out, re.M) and re.search(r"^durable\s+step 4: OK", r.out, re.M)
    assert "the memory copy fails verification" in r.err
    missing = cli(*store.argv(), "verify", "5")
    assert missing.rc == 3 and "committed steps: 4" in missing.err


def test_show_lists_tensors_shapes_dtypes_bytes_and_where_the_step_is(store, cli) -> None:  # type: ignore[no-untyped-def]
    store.save(3, durable=(3,))
    r = cli(*store.argv(), "show", "3")
    assert r.rc == 0, r.err
    assert f"namespace {NS}  step 3  world size 1" in r.out
    assert re.search(rf"memory\s+committed .* saved \d{{4}}-\d\d-\d\d .*{store.memory_step(3)}", r.out)
    assert re.search(rf"durable\s+committed .* saved \d{{4}}-\d\d-\d\d .*{store.durable_step(3)}", r.out)
    assert re.search(r"model\.embed\.weight\s+float32\s+\(32, 16\)\s+2048$", r.out, re.M)
    assert re.search(r"model\.layer\.0\.bias\s+bfloat16\s+\(16,\)\s+32$", r.out, re.M)
    assert re.search(r"model\.layer\.0\.ids\s+int64\s+\(7,\)\s+56$", r.out, re.M)
    assert re.search(r"optim\.exp_avg\s+float16\s+\(32, 16\)\s+1024$", r.out, re.M)
    assert "4 tensor(s)" in r.out and "2 other object(s)" in r.out and re.search(r"^\s+lr\s+object", r.out, re.M)


def test_show_json_matches_the_saved_state(store, cli) -> None:  # type: ignore[no-untyped-def]
    store.save(3)
    r = cli(*store.argv(durable=False), "show", "3", "--json")
    assert r.rc == 0
    info = json.loads(r.out)
    flat = {f"model.{k}": v for k, v in model_state(3)["model"].items()} | {"optim.exp_avg": model_state(3)["optim"]["exp_avg"]}
    assert {t["name"]: (t["shape"], t["dtype"], t["bytes"]) for t in info["tensors"]} == {
        k: (list(v.shape), str(v.dtype).removeprefix("torch."), v.numel() * v.element_size()) for k, v in flat.items()}
    assert sorted(o["name"] for o in info["objects"]) == ["epoch", "lr"]
    assert info["world_size"] == 1 and [c["tier"] for c in info["copies"]] == ["memory"]
    assert info["copies"][0]["saved_at"] > 0


def test_show_of_a_missing_step_is_exit_3_naming_the_steps_there(store, cli) -> None:  # type: ignore[no-untyped-def]
    store.save(1, 2)
    r = cli(*store.argv(), "show", "7")
    assert r.rc == 3 and "step 7 of namespace 'run1' is in no tier (committed steps: 1, 2)" in r.err


def test_verify_of_a_partial_copy_says_what_is_missing(store, cli) -> None:  # type: ignore[no-untyped-def]
    store.save(1)
    torn = store.durable_step(9)
    torn.mkdir(parents=True)
    (torn / "__0_0.distcp").write_bytes(b"x" * 64)  # data without manifest or marker: a copy that died
    r = cli(*store.argv(), "verify", "9")
    assert r.rc == 4
    assert re.search(r"^durable\s+step 9: BAD", r.out, re.M) and "does not exist" in r.out
