"""``tierckpt run`` as a program exits with the code it decided, its output flushed, whatever
threads are still blocked (``tierckpt.cli._exit_as_decided``), on a real interpreter."""

from __future__ import annotations

import subprocess
import sys

_PROGRAM = """
import logging, sys, threading, time
from tierckpt.cli import _exit_as_decided
threading.Thread(target=time.sleep, args=(600,)).start()  # not a daemon: a normal exit would wait for it
logging.basicConfig(stream=sys.stderr, level=logging.INFO)
logging.getLogger("t").info("logged before the exit")
print("printed before the exit", end="")
_exit_as_decided(75)
"""


def test_the_decided_code_with_output_flushed_and_a_thread_left_blocked() -> None:
    out = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True, timeout=60)
    assert out.returncode == 75, out
    assert out.stdout == "printed before the exit"
    assert "logged before the exit" in out.stderr
