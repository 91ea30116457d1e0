"""``CheckpointConfig(...)`` built in a worker takes ``tierckpt run``'s settings (issue 15, item 7).

Each rank gets the variables the launcher exports (``TIERCKPT_NAMESPACE``,
``TIERCKPT_MEMORY_DIR``) and builds its config as the README does, leaving them unset: the
steps land in the launcher's memory dir under the launcher's namespace, and a resume with the
README's loop continues after the loaded step.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import tierckpt
from tests.helpers.dist import run_ranks
from tests.helpers.state import small_state, zeros_like_state

pytestmark = pytest.mark.slow


def _readme_loop(rank: int, memory_dir: str, total: int) -> list[int]:
    os.environ["TIERCKPT_NAMESPACE"] = "from-launcher"  # what tierckpt run exports to its workers
    os.environ["TIERCKPT_MEMORY_DIR"] = memory_dir
    cfg = tierckpt.CheckpointConfig(memory_steps_retained=2, durable_every_n_steps=100)
    ran = []
    with tierckpt.Checkpointer(cfg) as ck:
        start = ck.load(zeros_like_state(small_state(0, rank)))
        for step in range(0 if start is None else start + 1, total):
            ran.append(step)
            ck.save(step, small_state(step, rank))
        ck.wait()
    return ran


def test_worker_config_follows_the_launcher_and_resumes_after_the_loaded_step(shm) -> None:
    root = shm("launcher")
    assert run_ranks(_readme_loop, 2, root, 3, timeout=120) == [[0, 1, 2]] * 2
    assert sorted(p.name for p in (Path(root) / "from-launcher").glob("step_*")) == ["step_1", "step_2"]
    assert run_ranks(_readme_loop, 2, root, 5, timeout=120) == [[3, 4]] * 2  # step 2 is not run again
