"""kill -9 of a saving process: the newest committed step always loads, bitwise equal.

Two kinds of kill:
* timed: a parent sends SIGKILL to a process that resumes and saves in a loop (64 MiB
  state) after varying delays, so kills land in staging, checksumming, commit, retention
  and the durable drain; every restart checks the resumed step against the acknowledged
  saves and recomputes what that step must hold;
* pinned: the saving process SIGKILLs itself at a named point of the save path (wrapping
  the tier, slot and commit seams in the child only; the library is unchanged), so every
  window the protocol has is hit every run.
After each crash a fresh process must load the right step and keep saving: stale staging
removed, slots reused, shared memory bounded.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

import tierckpt
from tests.helpers.dist import RankFailed, run_alone, run_ranks, start_alone
from tests.helpers.state import assert_state_equal, from_wire, small_state, to_wire, zeros_like_state

NS = "kill9"
K = 1_000_003  # int64 values of step s: arange + s * K (exact)

pytestmark = pytest.mark.slow


# -- the state: a pure function of the step ------------------------------------------------
def expected(step: int, mib: int) -> dict:
    n = mib * 2**20 // 16  # int64 "a" and float32 "b" hold half the bytes each
    return {
        "a": torch.arange(n, dtype=torch.int64).add_(step * K),
        "b": torch.arange(2 * n, dtype=torch.float32).mul_(0.5).add_(step),  # < 2**24: exact
        "meta": {"step": step},
    }


def advance(sd: dict, to_step: int) -> None:
    """Turn the state of ``sd['meta']['step']`` into that of ``to_step``, in place."""
    delta = to_step - sd["meta"]["step"]
    sd["a"].add_(delta * K)
    sd["b"].add_(float(delta))
    sd["meta"] = {"step": to_step}


def equal(sd: dict, step: int, mib: int) -> bool:
    want = expected(step, mib)
    return torch.equal(sd["a"], want["a"]) and torch.equal(sd["b"], want["b"]) and sd["meta"] == want["meta"]


def _config(memory_dir: str, durable_url: str | None, every: int) -> tierckpt.CheckpointConfig:
    return tierckpt.CheckpointConfig(
        namespace=NS, memory_dir=memory_dir, durable_url=durable_url,
        memory_steps_retained=2, durable_every_n_steps=every if durable_url else 0,
    )


# -- timed kills ---------------------------------------------------------------------------
def _resume_and_save(memory_dir: str, durable_url: str | None, every: int, mib: int, log_path: str, run: int) -> None:
    """Resume (checking what was loaded), then save forever; log each step as it is acknowledged."""
    log = open(log_path, "a", buffering=1)  # line-buffered; this process only ends by SIGKILL

    def note(**kw) -> None:
        log.write(json.dumps({"run": run, **kw}) + "\n")

    with tierckpt.Checkpointer(_config(memory_dir, durable_url, every)) as ck:
        sd = expected(0, mib)
        sd["a"].zero_()
        sd["meta"] = {"step": -1}
        resumed = ck.load(sd)
        ok = resumed is None or equal(sd, resumed, mib)
        note(resumed=resumed, ok=ok, tiers=ck.last_load.get("tiers"))
        if not ok:
            return
        if resumed is None:
            sd = expected(0, mib)
        step, prev = (resumed or 0) + 1, None
        while True:
            advance(sd, step)
            handle = ck.save(step, sd)  # returns once staged; sd may change right after
            note(staged=step)
            if prev is not None:
                prev.memory_committed(timeout=60)  # save() already waited for it
                note(committed=prev.step)
            prev, step = handle, step + 1


def _entries(log_path: Path, run: int) -> list[dict]:
    if not log_path.exists():
        return []
    lines = [json.loads(x) for x in log_path.read_text().splitlines() if x.strip()]
    return [e for e in lines if e["run"] == run]


def _kill_rounds(mem: str, url: str | None, every: int, mib: int, log_path: Path, delays: list[float]) -> list[dict]:
    rounds, acked, staged = [], None, None
    for run, delay in enumerate(delays):
        proc = start_alone(_resume_and_save, mem, url, every, mib, str(log_path), run)
        try:
            deadline = time.monotonic() + 60
            while not any("staged" in e for e in _entries(log_path, run)):
                assert proc.is_alive(), f"saver died on its own (exit code {proc.exitcode}): {_entries(log_path, run)}"
                assert time.monotonic() < deadline, "saver made no progress in 60 s"
                time.sleep(0.005)
            time.sleep(delay)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
        got = _entries(log_path, run)
        start = got[0]
        assert start["ok"], f"resumed step {start['resumed']} is not what was saved at that step"
        resumed = -1 if start["resumed"] is None else start["resumed"]
        # every save acknowledged as committed survives; at most the one in flight is newer
        assert acked is None or resumed >= acked, (acked, start)
        assert staged is None or resumed <= staged + 1, (staged, start)
        committed = [e["committed"] for e in got if "committed" in e]
        acked = max(committed, default=start["resumed"])
        staged = max(e["staged"] for e in got if "staged" in e)
        rounds.append({"delay": delay, "resumed": start["resumed"], "acked": acked, "staged": staged})
    return rounds


def _after_crash(memory_dir: str, durable_url: str | None, every: int, mib: int, more: int) -> dict:
    """A fresh process: every committed step loads exactly; then saving goes on and stays bounded."""
    out: dict = {}
    with tierckpt.Checkpointer(_config(memory_dir, durable_url, every)) as ck:
        sd = expected(0, mib)
        newest = ck.load(sd)
        out["newest"], out["newest_ok"], out["tiers"] = newest, equal(sd, newest, mib), ck.last_load["tiers"]
        out["steps"] = {i.step: sorted(i.tiers) for i in ck.steps()}
        out["each_ok"] = {}
        for info in ck.steps():
            if "memory" in info.tiers:
                got = ck.load(sd, step=info.step)
                out["each_ok"][info.step] = got == info.step and equal(sd, info.step, mib)
        sd = expected(newest, mib)
        for step in range(newest + 1, newest + 1 + more):
            advance(sd, step)
            ck.save(step, sd)
        ck.wait()
        final = expected(0, mib)
        out["final"] = ck.load(final)
        out["final_ok"] = equal(final, out["final"], mib)
    ns = Path(memory_dir) / NS
    out["staging"] = sorted(os.listdir(ns / ".staging")) if (ns / ".staging").exists() else []
    out["trash"] = sorted(os.listdir(ns / ".trash")) if (ns / ".trash").exists() else []
    out["pins"] = sorted(os.listdir(ns / ".pins")) if (ns / ".pins").exists() else []
    out["step_dirs"] = sorted(p.name for p in ns.glob("step_*"))
    out["uncommitted"] = sorted(p.name for p in ns.glob("step_*") if not (p / "COMMITTED").exists())
    slots = sorted((ns / ".slots" / "rank_0").iterdir())
    out["slots"] = [p.name for p in slots]
    inodes = {(st.st_dev, st.st_ino): st.st_blocks * 512 for st in (f.stat() for f in ns.rglob("*") if f.is_file())}
    out["shm_bytes"] = sum(inodes.values())  # hard links (slot + step file) count once
    out["files"] = sorted((str(f.relative_to(ns)), f.stat().st_size, f.stat().st_nlink) for f in ns.rglob("*") if f.is_file())
    return out


def _load_durable_only(durable_url: str, empty_memory_dir: str, mib: int) -> dict:
    with tierckpt.Checkpointer(_config(empty_memory_dir, durable_url, 1)) as ck:
        sd = expected(0, mib)
        step = ck.load(sd)
        return {"step": step, "ok": step is not None and equal(sd, step, mib), "tiers": ck.last_load.get("tiers")}


def _check_bounded(out: dict, mib: int, retained: int = 2, *, slots: bool = True) -> None:
    summary = {k: out[k] for k in ("newest", "steps", "staging", "trash", "pins", "step_dirs", "slots", "shm_bytes")}
    assert out["newest_ok"] and all(out["each_ok"].values()), out
    assert out["final_ok"], out
    assert out["staging"] == [] and out["trash"] == [], f"stale staging or trash after restart: {summary}"
    assert out["pins"] == [], f"drain pins of dead processes keep slots busy: {summary}"
    assert out["uncommitted"] == [], f"step dirs without a marker linger: {summary}"
    assert len(out["step_dirs"]) == retained, summary
    if not slots:
        return
    # slots are reused: the retained steps, one more committed by a save killed before its
    # retention ran, one being written
    assert len(out["slots"]) <= retained + 2, f"slots not reused: {summary}"
    step_bytes = mib * 2**20 + 2**20
    assert out["shm_bytes"] <= (retained + 2) * step_bytes, f"shared memory not bounded: {summary}"


TIMED_MIB = 64


@pytest.mark.parametrize("with_durable", [False, True], ids=["memory-only", "memory+durable"])
def test_timed_kill9_during_saves(shm, durable, tmp_path, with_durable):
    mem = shm("kill")
    url = durable[0] if with_durable else None
    rng = random.Random(20240611 + with_durable)
    # two kills around the very first commit (nothing to resume yet), then random ones
    delays = [0.0, 0.01] + sorted(rng.uniform(0.0, 0.6) for _ in range(6))
    rounds = _kill_rounds(mem, url, 1, TIMED_MIB, tmp_path / "log.jsonl", delays)
    assert len(rounds) == len(delays)
    out = run_alone(_after_crash, mem, url, 1, TIMED_MIB, 3, timeout=120)
    assert rounds[-1]["acked"] <= out["newest"] <= rounds[-1]["staged"] + 1, (rounds[-1], out)
    assert out["newest_ok"] and all(out["each_ok"].values()) and out["final_ok"], out
    if with_durable:
        # the durable tier alone (a lost node) also yields a complete, exact step
        d = run_alone(_load_durable_only, url, shm("empty"), TIMED_MIB)
        assert d["ok"] and d["tiers"] == ["durable"], d
    # with drains in flight the slot count depends on the drain backlog at the kill:
    # test_slow_durable_tier_keeps_shared_memory_bounded pins that down deterministically
    _check_bounded(out, TIMED_MIB, slots=not with_durable)


# -- pinned kills --------------------------------------------------------------------------
PINNED_MIB = 4
KILL_STEP = 4
_ARMED = [False]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never reached


def _install(point: str, memory_dir: str, durable_root: str | None) -> None:
    """Wrap one seam of the save path so that, once armed, the process SIGKILLs itself there."""
    from tierckpt import runtime, staging
    from tierckpt.tiers import local

    def under(path: object, root: str | None) -> bool:
        return root is not None and str(path).startswith(root.rstrip("/") + "/")

    def wrap(owner: object, name: str, make) -> None:
        original = getattr(owner, name)  # AttributeError here: the seam moved; update this test
        setattr(owner, name, make(original))

    if point == "slot-scribbled":  # the copy into the chosen slot is torn at its worst
        def acquire(orig):
            def f(self, nbytes):
                slot = orig(self, nbytes)
                if _ARMED[0]:
                    slot.buffer.fill_(0xA5)
                    _die()
                return slot
            return f
        wrap(staging.SlotPool, "acquire", acquire)
    elif point in ("before-memory-link", "after-memory-link"):
        def put_file(orig):
            def f(self, *args, **kw):
                if _ARMED[0] and self.name == "memory" and point == "before-memory-link":
                    _die()
                orig(self, *args, **kw)
                if _ARMED[0] and self.name == "memory":
                    _die()
            return f
        wrap(local.LocalTier, "put_file", put_file)
    elif point in ("memory-before-marker", "durable-before-marker"):
        root = memory_dir if point.startswith("memory") else durable_root
        def write_bytes(orig):
            def f(path, *args, **kw):
                if _ARMED[0] and Path(path).name == "COMMITTED" and under(path, root):
                    _die()
                return orig(path, *args, **kw)
            return f
        wrap(local, "_write_bytes", write_bytes)
    elif point in ("memory-before-rename", "durable-before-rename"):
        root = memory_dir if point.startswith("memory") else durable_root
        def rename(orig):
            def f(src, dst, *args, **kw):
                if _ARMED[0] and Path(dst).name == f"step_{KILL_STEP}" and under(dst, root):
                    _die()
                return orig(src, dst, *args, **kw)
            return f
        wrap(os, "rename", rename)
    elif point == "memory-before-retention":
        def apply_retention(orig):
            def f(self, tier, policy):
                if _ARMED[0] and tier.name == "memory":
                    _die()
                return orig(self, tier, policy)
            return f
        wrap(runtime.RankRuntime, "apply_retention", apply_retention)
    elif point == "memory-mid-delete":  # the old step's marker is gone, its files are not
        def to_trash(orig):
            def f(self, path):
                if _ARMED[0] and self.name == "memory":
                    _die()
                return orig(self, path)
            return f
        wrap(local.LocalTier, "_to_trash", to_trash)
    elif point == "memory-after-trash":  # a re-save has moved one copy of the step to the trash
        def to_trash_then_die(orig):
            def f(self, path):
                orig(self, path)
                if _ARMED[0] and self.name == "memory":
                    _die()
            return f
        wrap(local.LocalTier, "_to_trash", to_trash_then_die)
    elif point == "durable-torn-copy":
        def copy_file(orig):
            def f(source, dest, *, fsync):
                if _ARMED[0] and under(dest, durable_root):
                    data = Path(source).read_bytes()
                    with open(dest, "wb") as out:
                        out.write(data[: len(data) // 2])
                        out.flush()
                        os.fsync(out.fileno())
                    _die()
                return orig(source, dest, fsync=fsync)
            return f
        wrap(local, "_copy_file", copy_file)
    else:
        raise ValueError(point)


def _crash_at(point: str, memory_dir: str, durable_url: str | None, durable_root: str | None) -> None:
    _install(point, memory_dir, durable_root)
    with tierckpt.Checkpointer(_config(memory_dir, durable_url, 1)) as ck:
        sd = expected(0, PINNED_MIB)
        for step in range(1, KILL_STEP):
            advance(sd, step)
            ck.save(step, sd)
        ck.wait()
        _ARMED[0] = True
        advance(sd, KILL_STEP)
        ck.save(KILL_STEP, sd)
        ck.wait()


# point → (newest memory step after the crash, newest durable step or None)
POINTS = {
    "slot-scribbled": (KILL_STEP - 1, None),
    "before-memory-link": (KILL_STEP - 1, None),
    "after-memory-link": (KILL_STEP - 1, None),
    "memory-before-marker": (KILL_STEP - 1, None),
    "memory-before-rename": (KILL_STEP - 1, None),
    "memory-before-retention": (KILL_STEP, None),
    "memory-mid-delete": (KILL_STEP, None),
    "durable-torn-copy": (KILL_STEP, KILL_STEP - 1),
    "durable-before-marker": (KILL_STEP, KILL_STEP - 1),
    "durable-before-rename": (KILL_STEP, KILL_STEP - 1),
}


@pytest.mark.parametrize("point", list(POINTS))
def test_pinned_kill9(shm, durable, point):
    memory_newest, durable_newest = POINTS[point]
    mem = shm("pinned")
    url, root = durable if durable_newest is not None else (None, None)
    proc = start_alone(_crash_at, point, mem, url, str(root) if root else None)
    proc.join(90)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
        pytest.fail(f"the saver did not reach {point!r} within 90 s")
    assert proc.exitcode == -signal.SIGKILL, f"the saver never reached {point!r} (exit code {proc.exitcode})"

    if durable_newest is not None:  # before anything else touches the tiers: durable alone
        d = run_alone(_load_durable_only, url, shm("empty"), PINNED_MIB)
        assert d["step"] == durable_newest and d["ok"] and d["tiers"] == ["durable"], d
    out = run_alone(_after_crash, mem, url, 1, PINNED_MIB, 3)
    assert out["newest"] == memory_newest, out
    assert "memory" in out["tiers"], out
    _check_bounded(out, PINNED_MIB)
    if root is not None:
        leftover = sorted(os.listdir(root / NS / ".staging")) if (root / NS / ".staging").exists() else []
        assert leftover == [], f"durable staging of the dead saver was never removed: {leftover}"


def _resave_newest(memory_dir: str) -> None:
    _install("memory-after-trash", memory_dir, None)
    cfg = _config(memory_dir, None, 0).replace(memory_steps_retained=1)
    with tierckpt.Checkpointer(cfg) as ck:
        sd = expected(0, PINNED_MIB)
        for step in range(1, KILL_STEP + 1):
            advance(sd, step)
            ck.save(step, sd)
        ck.wait()
        _ARMED[0] = True
        ck.save(KILL_STEP, sd)  # the same step again (e.g. a final save right after a periodic one)
        ck.wait()


def _load_newest(memory_dir: str, mib: int) -> dict:
    with tierckpt.Checkpointer(_config(memory_dir, None, 0)) as ck:
        sd = expected(0, mib)
        step = ck.load(sd)
        return {"step": step, "ok": step is not None and equal(sd, step, mib)}


def test_kill9_while_resaving_the_newest_step_keeps_it(shm):
    mem = shm("resave")
    proc = start_alone(_resave_newest, mem)
    proc.join(90)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
    assert proc.exitcode == -signal.SIGKILL, f"the re-save never moved a copy to the trash (exit code {proc.exitcode})"
    # the only committed step (memory_steps_retained=1) must survive a re-save that died
    out = run_alone(_load_newest, mem, PINNED_MIB)
    assert out["step"] == KILL_STEP and out["ok"], out


# -- one rank of two killed mid-save ----------------------------------------------------------
def _two_ranks_crash(rank: int, point: str, victim: int, memory_dir: str) -> None:
    if rank == victim:
        _install(point, memory_dir, None)
    with tierckpt.Checkpointer(_config(memory_dir, None, 0)) as ck:
        for step in range(1, KILL_STEP):
            ck.save(step, small_state(step, rank))
        ck.wait()
        _ARMED[0] = True
        ck.save(KILL_STEP, small_state(KILL_STEP, rank))
        ck.wait()


def _two_ranks_resume(rank: int, memory_dir: str) -> dict:
    with tierckpt.Checkpointer(_config(memory_dir, None, 0)) as ck:
        sd = zeros_like_state(small_state(0, rank))
        step = ck.load(sd)
        out = {"step": step, "state": to_wire(sd)}
        for s in range(step + 1, step + 4):
            ck.save(s, small_state(s, rank))
        ck.wait()
        sd = zeros_like_state(sd)
        out["final"] = ck.load(sd)
        out["final_state"] = to_wire(sd)
    ns = Path(memory_dir) / NS
    out["staging"] = sorted(os.listdir(ns / ".staging")) if (ns / ".staging").exists() else []
    out["step_dirs"] = sorted(p.name for p in ns.glob("step_*"))
    out["slots"] = sorted(p.name for p in (ns / ".slots" / f"rank_{rank}").iterdir())
    return out


@pytest.mark.parametrize(
    ("point", "victim"), [("after-memory-link", 1), ("memory-before-marker", 0)],
    ids=["rank1-after-its-file-is-linked", "coordinator-before-the-marker"],
)
def test_one_of_two_ranks_killed_mid_save(shm, point, victim):
    mem = shm("tworanks")
    with pytest.raises(RankFailed) as failed:
        run_ranks(_two_ranks_crash, 2, point, victim, mem, timeout=60)
    assert f"--- rank {victim} ---\ndied without a result (exit code -9)" in str(failed.value), str(failed.value)[-2000:]
    # the job restarts: both ranks agree on the newest step that was committed, exactly
    outs = run_ranks(_two_ranks_resume, 2, mem)
    for rank, out in enumerate(outs):
        assert out["step"] == KILL_STEP - 1, out["step"]
        assert_state_equal(from_wire(out["state"]), small_state(KILL_STEP - 1, rank))
        assert out["final"] == KILL_STEP + 2
        assert_state_equal(from_wire(out["final_state"]), small_state(KILL_STEP + 2, rank))
        assert out["staging"] == [] and len(out["step_dirs"]) == 2, out
        assert len(out["slots"]) <= 4, out["slots"]


# -- a durable tier slower than the saves ----------------------------------------------------
def _save_ahead_of_slow_drain(memory_dir: str, durable_url: str, mib: int, steps: int, delay: float) -> dict:
    """Saves every step to a durable tier that takes ``delay`` per file (a slow NFS or S3)."""
    from tierckpt.tiers import local

    put_file = local.LocalTier.put_file

    def slow_put_file(self, *args, **kw):
        if self.name == "durable":
            time.sleep(delay)
        return put_file(self, *args, **kw)

    local.LocalTier.put_file = slow_put_file
    ns = Path(memory_dir) / NS
    most = 0
    with tierckpt.Checkpointer(_config(memory_dir, durable_url, 1)) as ck:
        sd = expected(0, mib)
        for step in range(1, steps + 1):
            advance(sd, step)
            ck.save(step, sd)
            most = max(most, len(list((ns / ".slots" / "rank_0").iterdir())))
        ck.wait()
        final = expected(0, mib)
        newest = ck.load(final)
        return {"most_slots": most, "newest": newest, "ok": equal(final, newest, mib),
                "durable": sorted(i.step for i in ck.steps() if "durable" in i.tiers)}


def test_slow_durable_tier_keeps_shared_memory_bounded(shm, durable):
    url, _ = durable
    out = run_alone(_save_ahead_of_slow_drain, shm("slow"), url, 8, 10, 0.25, timeout=120)
    assert out["newest"] == 10 and out["ok"], out
    assert 10 in out["durable"], out  # the newest step always reaches the durable tier
    # retained steps + one being written + one draining + one queued: never one slot per save
    assert out["most_slots"] <= 2 + 3, f"each save waiting for a slow drain pins another slot: {out}"
