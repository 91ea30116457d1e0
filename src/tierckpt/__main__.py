"""``python -m tierckpt ...``: the same as the ``tierckpt`` command (for a venv whose scripts are
not on PATH, and for tests that must run the CLI with one named interpreter)."""

from __future__ import annotations

import sys

from tierckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
