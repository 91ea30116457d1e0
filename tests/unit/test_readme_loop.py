"""The README's loop and the examples resume after the loaded step and follow the launcher.

Issue 15, item 7: ``range(start or 0, total)`` ran the loaded step twice, and the README's and
the examples' explicit ``memory_dir`` / ``namespace`` overrode ``tierckpt run``'s.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "examples").glob("*.py")) + sorted((ROOT / "src" / "tierckpt" / "demo").glob("*.py"))


def test_no_loop_restarts_at_the_loaded_step() -> None:
    for path in [ROOT / "README.md", *SCRIPTS]:
        text = path.read_text()
        assert not re.search(r"range\(\s*\w+ or 0\s*,", text), f"{path}: the loaded step would run again"
    readme = (ROOT / "README.md").read_text()
    assert "range(0 if start is None else start + 1, total)" in readme


def test_readme_config_leaves_the_launchers_settings_unset() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("cfg = tierckpt.CheckpointConfig("):]
    block = block[: block.index("\n)\n")]
    for field in ("namespace", "memory_dir", "durable_url"):
        assert not re.search(rf"^\s+{field}=", block, re.M), f"README config sets {field} over tierckpt run's"


def test_examples_do_not_override_the_launcher_with_defaults() -> None:
    for path in SCRIPTS:
        text = path.read_text()
        for flag in ("--memory-dir", "--namespace"):
            match = re.search(rf'add_argument\("{flag}", default=([^,)]+)', text)
            assert match is None or match.group(1) == "None", f"{path}: {flag} defaults to {match.group(1)}"
