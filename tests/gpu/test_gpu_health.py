"""The health monitor's gpu check against a real ``nvidia-smi`` (the lent GPU machine); skipped where
``nvidia-smi`` is not on PATH. The unit tests run the same check on a fake ``nvidia-smi``
(tests/unit/launcher/test_health.py); this one proves the query's fields exist and parse on a real
driver, and that a healthy GPU machine does not fail it.

    python -m pytest -q tests/gpu/test_gpu_health.py
"""

from __future__ import annotations

import shutil
import time

import pytest

from tierckpt.launcher.detect.health import OK, GpuCheck, HealthConfig, build_checks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi"),
]


def test_a_healthy_gpu_machine_passes_the_gpu_check() -> None:
    assert "gpu" in [c.name for c in build_checks(HealthConfig(checks=None))]  # on by default here
    check = GpuCheck("nvidia-smi", timeout_s=30)
    for _ in range(2):  # the second round judges the ECC counters by their increase
        t0 = time.monotonic()
        results = check.run()
        took = time.monotonic() - t0
        assert results and all(r.status == OK for r in results), results
        assert all(r.subject.startswith("gpu") for r in results), results
        assert took < 10.0, took
