"""``tierckpt bench gpu``: without CUDA it says so and exits 2 (on a GPU machine tests/gpu runs it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


@pytest.mark.slow  # 20-33 s on the loaded 2-core box: a fresh interpreter with torch, or a seed round-trip
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: tests/gpu covers the suite")
def test_without_cuda_the_suite_exits_2_with_a_clear_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "tierckpt.cli", "bench", "gpu"], capture_output=True, text=True,
                          timeout=120, env=os.environ)
    assert proc.returncode == 2, proc.stderr
    assert "skipped: no CUDA device" in proc.stdout
