"""symptom.py: which crashes are a peer's failure seen from a survivor (the settle window: test_diagnose.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierckpt.launcher.detect.symptom import peer_failure, tail

GLOO_RESET = ("[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
              "Read error [127.0.0.1]:62634: Connection reset by peer. This is typically caused by a remote "
              "worker hanging or bugs in the application.")
GLOO_CLOSED = ("[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
               "Connection closed by peer [127.0.0.1]:2711. This is typically caused by a remote worker crashing.")
NCCL = "torch.distributed.DistBackendError: NCCL communicator was aborted on rank 3."


@pytest.mark.parametrize("line", [GLOO_RESET, GLOO_CLOSED, NCCL])
def test_a_collective_that_lost_its_peer_is_a_symptom(line: str) -> None:
    text = f"Traceback (most recent call last):\n  File \"train.py\", line 8\n    dist.all_reduce(t)\n{line}\n"
    got = peer_failure(text)
    assert got is not None and got == line.strip()[:200]


@pytest.mark.parametrize("text", [
    "Traceback (most recent call last):\nValueError: shapes (3,) and (4,) do not match\n",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n",
    "",
])
def test_a_crash_of_its_own_is_no_symptom(text: str) -> None:
    assert peer_failure(text) is None


def test_tail_reads_the_end_of_a_long_output(tmp_path: Path) -> None:
    out = tmp_path / "stderr.log"
    out.write_text("x" * 100_000 + "\n" + GLOO_RESET + "\n")
    assert peer_failure(tail(out)) is not None
    assert len(tail(out, 1000)) == 1000
    assert tail(tmp_path / "absent") == "" and tail(None) == ""
