"""In-process restart with NCCL (abort and re-create the group) and the GPU bench, on a CUDA machine.

Skipped without CUDA. Run: ``pytest -m gpu tests/gpu`` on the GPU machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.timeout(600)
def test_bench_gpu_measures_the_save_and_an_nccl_in_process_restart(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "tierckpt.cli", "bench", "gpu", "--mib", "256", "--repeats", "3",
                           "--json", str(out)], capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["save"]["stall_s"] > 0 and doc["save"]["d2h_s"] > 0
    ip = doc["inprocess"]
    assert ip["resumed_step"] == 2, "generation 1 must resume from the step saved before the fault"
    assert {"pg", "load", "first_step"} <= set(ip["stages_s"])
