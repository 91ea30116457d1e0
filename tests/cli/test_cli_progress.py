"""Progress output: a tqdm bar on a terminal, a line per tenth of the work otherwise, none on request."""

from __future__ import annotations

import io
import re

import pytest

from tierckpt.commands import progress
from tierckpt.commands.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _auto_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "MODE", "auto")


def test_plain_lines_one_per_tenth_then_done() -> None:
    stream = io.StringIO()
    with Progress("verify", 1000 * 1024, unit="B", stream=stream) as bar:
        for i in range(100):
            bar.update(10 * 1024, f"file {i}")
    lines = stream.getvalue().splitlines()
    assert [int(re.match(r"verify:\s+(\d+)%", line).group(1)) for line in lines] == [1, *range(10, 100, 10), 100]  # type: ignore[union-attr]
    assert re.fullmatch(r"verify:   1% 10\.0 KiB/1000\.0 KiB \d+\.\ds  file 0", lines[0])
    assert re.fullmatch(r"verify: 100% 1000\.0 KiB/1000\.0 KiB \d+\.\ds  done", lines[-1])


def test_a_terminal_gets_a_tqdm_bar() -> None:
    pytest.importorskip("tqdm", reason="the 'cli' extra")
    stream = _Terminal()
    with Progress("promote step 3", 4 << 20, unit="B", stream=stream) as bar:
        assert bar.mode == "bar"
        for _ in range(4):
            bar.update(1 << 20, "__0_0.distcp")
    text = stream.getvalue()
    assert "\r" in text and "promote step 3: 100%" in text and "4.00M/4.00M" in text and "__0_0.distcp" in text


def test_a_failure_ends_the_lines_with_stopped() -> None:
    stream = io.StringIO()
    with pytest.raises(RuntimeError), Progress("gc", 3, stream=stream) as bar:
        bar.update(1, "a")
        raise RuntimeError("boom")
    assert stream.getvalue().splitlines()[-1].endswith("stopped")


def test_progress_none_keeps_stderr_empty_and_bar_forces_tqdm(store, cli) -> None:  # type: ignore[no-untyped-def]
    store.save(2, durable=(2,))
    quiet = cli("--progress", "none", *store.argv(), "verify", "2")
    assert quiet.rc == 0 and quiet.err == ""
    plain = cli(*store.argv(), "verify", "2")  # captured output is not a terminal: lines
    assert plain.err.splitlines()[-1].startswith("verify: 100%")
    forced = cli(*store.argv(), "verify", "2", "--progress", "bar")
    assert "\r" in forced.err and "verify: 100%" in forced.err
