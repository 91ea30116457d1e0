"""Flipped bytes and a lost memory root, seen by two real ranks on one node.

One checkpoint (steps 1-3 durable, 2-3 in memory) is saved once per module and copied for
each case, then damaged. Proves that a bad copy is never loaded: the same step comes from
the durable copy when there is one, else every rank falls back to the same older step with
a warning; an explicit step that is bad everywhere raises IntegrityError on every rank.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tierckpt
from tests.helpers.dist import run_alone, run_ranks
from tests.helpers.state import assert_state_equal, from_wire, small_state, to_wire, zeros_like_state

NS = "corrupt"

pytestmark = pytest.mark.slow


def _config(memory_dir: str, durable_url: str | None) -> tierckpt.CheckpointConfig:
    return tierckpt.CheckpointConfig(namespace=NS, memory_dir=memory_dir, durable_url=durable_url, memory_steps_retained=2)


def _save(rank: int, memory_dir: str, durable_url: str) -> None:
    with tierckpt.Checkpointer(_config(memory_dir, durable_url)) as ck:
        for step in (1, 2, 3):
            ck.save(step, small_state(step, rank))
        ck.wait()


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """The saved checkpoint: memory tier (steps 2, 3) and durable tier (steps 1-3)."""
    base = tmp_path_factory.mktemp("corrupt-template")
    mem = Path(base / "memory")
    mem.mkdir()
    run_ranks(_save, 2, str(mem), f"file://{base / 'durable'}")
    for tier, steps in (("memory", ["step_2", "step_3"]), ("durable", ["step_1", "step_2", "step_3"])):
        assert sorted(p.name for p in (base / tier / NS).glob("step_*")) == steps
    return base


@pytest.fixture
def tiers(template, shm, tmp_path):
    """A private copy of the template: (memory root on /dev/shm, durable URL, durable root)."""
    mem = Path(shm("corrupt"))
    shutil.copytree(template / "memory" / NS, mem / NS, ignore=shutil.ignore_patterns(".slots"))
    shutil.copytree(template / "durable", tmp_path / "durable")
    return mem, f"file://{tmp_path / 'durable'}", tmp_path / "durable"


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def flip_kind(step_dir: Path, kind: str) -> str:
    """Flip one byte that matters in ``kind`` of a step; return what was flipped."""
    if kind == "data":  # inside a tensor's raw bytes in rank 1's file
        manifest = json.loads((step_dir / "manifest.json").read_text())
        name, offset, _, data_offset, _ = next(i for i in manifest["items"] if i[0] == "__1_0.distcp" and i[3] >= 0)
        flip(step_dir / name, offset + data_offset + 7)
        return name
    if kind == "metadata":
        flip(step_dir / ".metadata", (step_dir / ".metadata").stat().st_size // 2)
        return ".metadata"
    if kind == "manifest":
        flip(step_dir / "manifest.json", (step_dir / "manifest.json").stat().st_size // 2)
        return "manifest.json"
    if kind == "marker":  # a hex digit of the manifest checksum the marker seals
        raw = (step_dir / "COMMITTED").read_text()
        flip(step_dir / "COMMITTED", raw.index(json.loads(raw)["manifest_xxh3"]) + 3)
        return "COMMITTED"
    raise ValueError(kind)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _load(rank: int, memory_dir: str, durable_url: str | None, step: int | None) -> dict:
    records = _Records()
    logging.getLogger("tierckpt").addHandler(records)
    sd = zeros_like_state(small_state(0, rank))
    reader = tierckpt.TieredStorageReader(_config(memory_dir, durable_url), step=step)
    out: dict = {}
    try:
        dcp.load(sd, storage_reader=reader)
        out = {"step": reader.step, "files": dict(reader.tiers_used), "skipped": [s for s, _ in reader.skipped]}
    except CheckpointException as exc:
        out = {"error": type(reader.failure).__name__ if reader.failure else repr(exc)}
    with tierckpt.Checkpointer(_config(memory_dir, durable_url)) as ck:
        sd2 = zeros_like_state(small_state(0, rank))
        try:
            got = ck.load(sd2, step=step)
            skipped = [s if isinstance(s, int) else s[0] for s in ck.last_load.get("skipped", [])]
            out["ck"] = {"step": got, "tiers": ck.last_load.get("tiers"), "skipped": skipped, "state": to_wire(sd2)}
        except tierckpt.TierckptError as exc:
            out["ck"] = {"error": type(exc).__name__, "message": str(exc)}
    out["state"] = to_wire(sd)
    out["warnings"] = records.messages
    return out


KINDS = ["data", "metadata", "manifest", "marker"]


@pytest.mark.parametrize("kind", KINDS)
def test_flipped_newest_memory_copy_falls_back_to_its_durable_copy(tiers, kind):
    mem, url, _ = tiers
    flipped = flip_kind(mem / NS / "step_3", kind)
    outs = run_ranks(_load, 2, str(mem), url, None)
    for rank, out in enumerate(outs):
        assert out["step"] == 3, out  # the same step, from the good copy
        assert_state_equal(from_wire(out["state"]), small_state(3, rank))
        assert out["ck"]["step"] == 3 and out["ck"]["skipped"] == [], out["ck"]
        assert_state_equal(from_wire(out["ck"]["state"]), small_state(3, rank))
        if flipped.endswith(".distcp") and flipped in out["files"]:
            assert out["files"][flipped] == "durable", out["files"]  # never the bad memory copy
        if kind in ("manifest", "marker"):  # the node's whole memory copy of step 3 is unusable
            assert set(out["files"].values()) == {"durable"}, out["files"]
    if kind == "data":
        assert outs[1]["files"]["__1_0.distcp"] == "durable"  # rank 1's own file: the good copy
        assert outs[0]["files"]["__0_0.distcp"] == "memory"  # rank 0's good file still from memory


def _no_durable_copy_of_newest(tiers, kind: str) -> list[dict]:
    mem, url, droot = tiers
    shutil.rmtree(droot / NS / "step_3")  # step 3 exists only in memory now
    flip_kind(mem / NS / "step_3", kind)
    return run_ranks(_load, 2, str(mem), url, None)


@pytest.mark.parametrize("kind", KINDS)
def test_flipped_newest_step_without_durable_copy_falls_back_to_older_step(tiers, kind):
    for rank, out in enumerate(_no_durable_copy_of_newest(tiers, kind)):
        assert out["ck"]["step"] == 2 and 3 in out["ck"]["skipped"], out["ck"]  # every rank: the same step
        assert_state_equal(from_wire(out["ck"]["state"]), small_state(2, rank))
        # the warning names the step given up and says what was done instead
        assert any(re.match(rf"\[Rank {rank}\] Step 3: .*(trying an older step|loading step 2 instead)", m)
                   for m in out["warnings"]), out["warnings"]


@pytest.mark.parametrize("kind", KINDS)
def test_flipped_newest_step_without_durable_copy_dcp_reader_falls_back(tiers, kind):
    for rank, out in enumerate(_no_durable_copy_of_newest(tiers, kind)):
        assert out.get("step") == 2 and 3 in out["skipped"], out.get("error", out.get("skipped"))
        assert_state_equal(from_wire(out["state"]), small_state(2, rank))


@pytest.mark.parametrize("kind", ["data", "metadata", "manifest"])
def test_explicit_step_bad_in_every_tier_raises_integrity_error(tiers, kind):
    mem, url, droot = tiers
    flip_kind(mem / NS / "step_3", kind)
    flip_kind(droot / NS / "step_3", kind)
    outs = run_ranks(_load, 2, str(mem), url, 3)
    for out in outs:
        assert out["error"] == "IntegrityError" or "IntegrityError" in out["error"], out
        assert out["ck"].get("error") == "IntegrityError", out["ck"]
    # the latest load still finds a good step: 2 (both tiers hold it intact)
    for rank, out in enumerate(run_ranks(_load, 2, str(mem), url, None)):
        assert out["ck"]["step"] == 2, out["ck"]
        assert_state_equal(from_wire(out["ck"]["state"]), small_state(2, rank))


def _load_alone(memory_dir: str, durable_url: str | None) -> dict:
    full = {**small_state(0, 0), **small_state(0, 1)}
    sd = zeros_like_state(full)
    with tierckpt.Checkpointer(_config(memory_dir, durable_url)) as ck:
        step = ck.load(sd)
        skipped = [s if isinstance(s, int) else s[0] for s in ck.last_load["skipped"]]
        return {"step": step, "tiers": ck.last_load["tiers"], "skipped": skipped, "state": to_wire(sd)}


def test_flipped_file_only_read_after_agreement_falls_back_in_one_process(tiers):
    # Checkpointer.load skips the pre-read pass: the damage is found while the record is read
    mem, _, _ = tiers
    flip_kind(mem / NS / "step_3", "data")
    out = run_alone(_load_alone, str(mem), None)
    assert out["step"] == 2 and 3 in out["skipped"] and out["tiers"] == ["memory"], out
    assert_state_equal(from_wire(out["state"]), {**small_state(2, 0), **small_state(2, 1)})


def test_lost_memory_root_loads_from_durable(tiers):
    mem, url, _ = tiers
    shutil.rmtree(mem)  # the node's /dev/shm was wiped (reboot, node replaced)
    for rank, out in enumerate(run_ranks(_load, 2, str(mem), url, None)):
        assert out["step"] == 3 and set(out["files"].values()) == {"durable"}, out
        assert out["ck"]["step"] == 3 and out["ck"]["tiers"] == ["durable"], out["ck"]
        assert_state_equal(from_wire(out["ck"]["state"]), small_state(3, rank))
    # nothing anywhere: a fresh start, not an error
    shutil.rmtree(mem, ignore_errors=True)
    for out in run_ranks(_load, 2, str(mem), None, None):
        assert out["ck"]["step"] is None, out["ck"]


def _load_alone_dcp(memory_dir: str) -> dict:
    full = {**small_state(0, 0), **small_state(0, 1)}
    sd = zeros_like_state(full)
    reader = tierckpt.TieredStorageReader(_config(memory_dir, None))
    try:
        dcp.load(sd, storage_reader=reader)
    except CheckpointException:
        return {"error": type(reader.failure).__name__}
    return {"step": reader.step, "state": to_wire(sd)}


def test_flipped_file_only_read_after_agreement_dcp_reader_falls_back(tiers):
    # plain dcp.load: the reader's pre-read check (verify_ahead) finds the damage, so dcp.load
    # itself moves to step 2 (the Checkpointer test above finds it while reading instead)
    mem, _, _ = tiers
    flip_kind(mem / NS / "step_3", "data")
    out = run_alone(_load_alone_dcp, str(mem))
    assert out.get("step") == 2, out
    assert_state_equal(from_wire(out["state"]), {**small_state(2, 0), **small_state(2, 1)})


def _lost_memory_flipped_durable(tiers, kind: str) -> list[dict]:
    mem, url, droot = tiers
    shutil.rmtree(mem)
    flip_kind(droot / NS / "step_3", kind)
    return run_ranks(_load, 2, str(mem), url, None)


@pytest.mark.parametrize("kind", ["data", "metadata"])
def test_lost_memory_root_and_flipped_durable_newest_falls_back_to_older_durable_step(tiers, kind):
    outs = _lost_memory_flipped_durable(tiers, kind)
    for rank, out in enumerate(outs):
        assert out["ck"]["step"] == 2 and out["ck"]["tiers"] == ["durable"], out["ck"]
        assert_state_equal(from_wire(out["ck"]["state"]), small_state(2, rank))
    # a warning names the damaged step (for damaged metadata only rank 0 sees it: it lists durable)
    assert any(re.match(r"\[Rank \d\] Step 3: .*(rejected|skipped|older step|unusable)", m)
               for out in outs for m in out["warnings"]), [o["warnings"] for o in outs]


@pytest.mark.parametrize("kind", ["data", "metadata"])
def test_lost_memory_root_and_flipped_durable_newest_dcp_reader_falls_back(tiers, kind):
    for rank, out in enumerate(_lost_memory_flipped_durable(tiers, kind)):
        assert out.get("step") == 2, out.get("error")
        assert_state_equal(from_wire(out["state"]), small_state(2, rank))
