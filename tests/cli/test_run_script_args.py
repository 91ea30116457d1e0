"""The training script's own arguments reach it untouched, whatever launcher options they begin like."""

from __future__ import annotations

import pytest

from tierckpt.launcher.cli import build_parser


@pytest.mark.parametrize("arg", ["--name", "--log", "--run", "--local", "--server", "--pre", "--post", "--shutdown",
                                 "--in", "--namespace", "--nnodes", "--lr"])
def test_a_script_argument_is_never_read_as_a_launcher_option(arg: str) -> None:
    ns = build_parser().parse_args(["--nnodes", "2", "train.py", arg, "v", "--other"])
    assert ns.training_script == "train.py" and ns.training_script_args == [arg, "v", "--other"]
    assert ns.nnodes == "2"


def test_launcher_options_are_spelled_out_in_full() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--namesp", "x", "train.py"])
