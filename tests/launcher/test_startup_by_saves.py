"""``startupDeadlineSeconds`` and a loop that only saves through the DCP plug-ins (issue 24, item 4):
its saves are its start (``monitor.saved`` from the DCP writer); before, such a healthy job was
failed with ``StartupDeadline`` because it never called ``monitor.step``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.launcher.cluster import LocalJob

pytestmark = pytest.mark.slow

DEADLINE_S = 40  # the first save comes within it, with the start-up under load (CI: a 20 s deadline
# failed once when a neighbouring test saturated both cores); the job runs past it
STEPS, STEP_TIME = 170, 0.3


@pytest.mark.parametrize("writer", ["sagemaker", "tiered"])
def test_a_loop_that_only_saves_meets_the_startup_deadline(make_job: Callable[..., LocalJob], tmp_path: Path,
                                                           writer: str) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(f"startupDeadlineSeconds: {DEADLINE_S}\n")
    job = make_job(train=["--steps", str(STEPS), "--step-time", str(STEP_TIME), "--writer", writer], job_file=spec)
    job.module = "tests.launcher.saves_only"
    job.start()
    codes = job.wait_exit(240)
    faults = [e for e in job.events() if e["event"] == "fault"]
    assert faults == [], job.report()
    assert codes == {0: 0, 1: 0}, job.report()
    for r in (0, 1):
        assert job.last_step(r) == STEPS and any(e["event"] == "done" for e in job.trace(r)), job.report()
    started = min(e["time"] for e in job.events() if e["event"] == "started")
    ended = max(e["time"] for e in job.events() if e["event"] == "exit")
    assert ended - started > DEADLINE_S, "the job ended before the deadline could have failed it"
