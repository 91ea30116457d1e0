"""The command itself: --version, --help with exit codes, each command's --help, option order."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import tierckpt
from tierckpt import cli as cli_module
from tierckpt.commands.bench import SUITES

from .conftest import NS

COMMAND_ARGS = {  # each command's --help must explain these
    "ls": ["--verify"],
    "show": ["STEP", "--json"],
    "verify": ["STEP"],
    "promote": ["STEP"],
    "export": ["STEP", "--to", "--format", "--prefix", "--max-shard-size", "--config"],
    "gc": ["--yes", "--min-age"],
    "demo": ["--steps", "--workdir"],
    "bench": ["SUITE", *SUITES],
    "agent": ["serve", "status", "flush"],
}


@pytest.mark.slow  # 20-33 s on the loaded 2-core box: a fresh interpreter with torch, or a seed round-trip
def test_version_through_the_installed_entry_point() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", "import sys; from tierckpt.cli import main; sys.exit(main())",
                           "--version"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0
    assert done.stdout.strip() == f"tierckpt {tierckpt.__version__}"


def test_top_help_lists_every_command_and_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_module.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in [*cli_module.COMMANDS, "run"]:
        assert f"    {name}" in out, name
    assert "exit codes:" in out
    for code, name in ((2, "ConfigError"), (3, "CheckpointNotFoundError"), (4, "IntegrityError"), (7, "StorageError")):
        assert f"  {code:<4} " in out and name in out


@pytest.mark.parametrize("command", sorted(COMMAND_ARGS))
def test_each_command_help_explains_its_arguments(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_module.main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for arg in COMMAND_ARGS[command]:
        assert arg in out, f"{command} --help does not mention {arg}"
    if command not in ("demo", "bench", "agent"):
        assert "--namespace" in out and "--durable-url" in out and "exit codes:" in out


def test_storage_options_work_before_and_after_the_command(store, cli) -> None:  # type: ignore[no-untyped-def]
    store.save(3)
    before = cli(*store.argv(), "ls")
    after = cli("ls", *store.argv())
    mixed = cli("--namespace", NS, "ls", "--memory-dir", str(store.memory_dir), "--durable-url", store.durable_url)
    assert before.rc == after.rc == mixed.rc == 0
    assert before.out == after.out == mixed.out
    assert f"{store.memory_step(3)}" in before.out


def test_the_environment_fills_in_options_not_given(store, cli, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    store.save(5)
    monkeypatch.setenv("TIERCKPT_NAMESPACE", NS)
    monkeypatch.setenv("TIERCKPT_MEMORY_DIR", str(store.memory_dir))
    r = cli("show", "5")
    assert r.rc == 0 and f"namespace {NS}  step 5" in r.out
    other = cli("show", "5", "--namespace", "elsewhere")  # an option beats the environment
    assert other.rc == 3 and "elsewhere" in other.err


def test_no_namespace_is_exit_2_naming_the_namespaces_there(store, cli, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("TIERCKPT_NAMESPACE", raising=False)
    store.save(1)
    r = cli("show", "1", "--memory-dir", str(store.memory_dir))
    assert r.rc == 2
    assert "no namespace" in r.err and f"namespaces under {store.memory_dir}: {NS}" in r.err


def test_a_bad_step_is_a_usage_error(cli) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exc:
        cli("show", "-3")
    assert exc.value.code == 2


def test_memory_dir_before_the_agent_command_reaches_the_agent(shm_root, cli) -> None:  # type: ignore[no-untyped-def]
    """No agent serves this fresh root, so status fails naming it: proof of which root was asked."""
    before = cli("--memory-dir", str(shm_root), "agent", "status")
    after = cli("agent", "status", "--memory-dir", str(shm_root))
    assert before.rc == after.rc == 7  # StorageError: nothing listens there
    assert str(shm_root) in before.err and before.err == after.err
