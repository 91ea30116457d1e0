"""The chaos soak with a real data pipeline: faults of every kind, bit-identical to a fault-free run.

The soak of ``test_soak.py`` (2 agents x 1 worker of ``tierckpt.demo.resilient``, AdamW, a save
every step), but every step's batch is read from 256 sample files on disk through a shuffled
``tierckpt.data.ResumableLoader`` with 2 worker processes per rank (``--data``), its position
saved with the model. Fixed plans, a few faults each (the full random soak stays in test_soak.py):

- ``resilient`` (``tierckpt.resilient``): a NaN and a hang restart in-process (the loader and its
  workers are kept and repositioned: same pid, the first batch traced), a SIGKILL replaces the rank
  alone (a new process, new workers, the position from the memory tier);
- ``process``: a SIGKILL, a lost node (an empty memory root: the position comes from the peer's
  replica) and a NaN restart the processes.

Every launcher runs with ``--warm-loader tierckpt.demo.data:make_loader``: a restarted rank that a
warm standby serves takes the loader the standby built ahead (its workers forked and warm), and
every resume asks the workers for the position's batches during the load (``prefetched``).

Asserted: every launcher exits 0, one fault reported per fault, every resume loaded a state saved
at its step, and the final parameters and optimizer state equal a fault-free run's with the same
loader, bit for bit. The control: with ``--no-data-restore`` (the position saved, never restored:
the data starts over after a restart, as in a loop that does not checkpoint it) one fault is
enough for the same comparison to fail.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.launcher.cluster import LocalJob
from tests.launcher.conftest import shm_dirs
from tests.launcher.test_soak import _bitwise_equal, _final, _new_faults, drive
from tierckpt.testing.files import write_samples

pytestmark = pytest.mark.slow

STEPS = 60
PLANS = {
    "resilient": [("nan", 1, 10), ("kill", 0, 12), ("hang", 1, 12)],
    "process": [("kill", 1, 10), ("node", 1, 12), ("nan", 0, 12)],
}


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("samples")
    write_samples(out, 256)
    return out


def _job(tmp: Path, shm: Any, samples: Path, *, inprocess: bool, restore: bool = True) -> LocalJob:
    inject = tmp / "inject"
    inject.mkdir(parents=True, exist_ok=True)
    train = ["--steps", str(STEPS), "--step-time", "0.1", "--optim", "adamw", "--inject-dir", str(inject),
             "--data", str(samples), "--data-workers", "2", "--batch-size", "8",
             *(["--inprocess"] if inprocess else []), *([] if restore else ["--no-data-restore"])]
    # the standbys build the demo's loader ahead: a rank started from one takes its workers warm
    return LocalJob(tmp, shm, train=train, node_timeout=10.0, max_restarts=50,
                    run_args=["--warm-loader", "tierckpt.demo.data:make_loader"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, samples: Path) -> Iterator[dict[int, Any]]:
    """The final state of a fault-free run with the same loader."""
    with shm_dirs("tierckpt-dataref") as shm:
        job = _job(tmp_path_factory.mktemp("ref"), shm, samples, inprocess=False)
        try:
            job.start()
            assert job.wait_exit(300) == {0: 0, 1: 0}, job.report()
            final = _final(job)
        finally:
            job.close()
        yield final


def _soak(job: LocalJob, faults: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    try:
        job.start()
        rows = drive(job, faults)
        assert job.wait_exit(300) == {0: 0, 1: 0}, job.report()
        assert len(_new_faults(job, 0)) == len(faults), ("one fault reported per fault injected", job.report())
        for r in (0, 1):
            saved = {(e["step"], e["digest"]) for e in job.trace(r) if e["event"] == "step"}
            for e in job.trace(r):
                if e["event"] == "resumed" and e["step"] is not None:
                    assert (e["step"], e["digest"]) in saved, ("resumed a state never saved at its step", r, e)
        return rows
    finally:
        job.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", sorted(PLANS))
def test_a_soak_with_a_shuffled_multi_worker_loader_ends_bit_identical(
        tmp_path: Path, shm: Any, samples: Path, reference: dict[int, Any], mode: str) -> None:
    job = _job(tmp_path / "soak", shm, samples, inprocess=mode == "resilient")
    t0 = time.monotonic()
    rows = _soak(job, PLANS[mode])
    got = _final(job)
    for r in (0, 1):
        _bitwise_equal(got[r], reference[r], f"rank {r}")
    print(f"\ndata soak ({mode}): {len(rows)} faults in {time.monotonic() - t0:.1f} s")
    for r in (0, 1):
        trace = job.trace(r)
        firsts = [e for e in trace if e["event"] == "step" and "batch_s" in e]
        pids = sorted({e["pid"] for e in trace})
        print(f"  rank {r}: processes {len(pids)}; first batch after each start/resume (s): "
              + ", ".join(f"{e['batch_s']:.4f}" + (f" (inproc {e['inproc']})" if e.get("inproc") else "")
                          for e in firsts))
    resumes = [e for r in (0, 1) for e in job.trace(r) if e["event"] == "resumed" and e["step"] is not None
               and not e.get("inproc")]
    print("  process starts that resumed: loader built ahead by a standby "
          f"{sum(1 for e in resumes if e.get('loader_warm'))} of {len(resumes)}; prefetched "
          + ", ".join(str(e.get("prefetched")) for e in resumes))
    assert resumes and all(e.get("prefetched") for e in resumes), resumes  # the workers asked during the load
    if mode == "process":  # restarted processes come from standbys that built the loader ahead
        assert any(e.get("loader_warm") for e in resumes), resumes
    if mode == "resilient":  # the NaN and the hang kept the processes: their loaders were repositioned
        kept = [e for r in (0, 1) for e in job.trace(r) if e["event"] == "step" and "batch_s" in e
                and (e.get("inproc") or 0) > 0]
        assert kept, "in-process generations traced their first batch"


@pytest.mark.timeout(300)
def test_the_soak_fails_when_the_loader_state_is_not_restored(
        tmp_path: Path, shm: Any, samples: Path, reference: dict[int, Any]) -> None:
    job = _job(tmp_path / "norestore", shm, samples, inprocess=True, restore=False)
    _soak(job, [("nan", 1, 10)])
    got = _final(job)
    with pytest.raises(AssertionError, match="differs"):
        for r in (0, 1):
            _bitwise_equal(got[r], reference[r], f"rank {r}")
