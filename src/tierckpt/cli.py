"""The ``tierckpt`` command: argv → config → library call; errors → exit codes.

    tierckpt [--namespace NS] [--memory-dir DIR] [--durable-url URL] COMMAND ...
    tierckpt ls [--verify] | verify STEP | show STEP | promote STEP | gc [--yes] | export STEP --to DIR
    tierckpt demo | bench SUITE | agent serve|status|flush | run [torchrun arguments] script ...
Settings fall back to TIERCKPT_NAMESPACE, TIERCKPT_MEMORY_DIR, TIERCKPT_DURABLE_URL.
Every command is a module with ``HELP``, ``add_arguments(parser)`` and ``main(args) -> int``
(``STORAGE = True`` gives it the storage options); it registers with one line in COMMANDS.
A ``TierckptError`` leaving a command becomes its ``exit_code`` (the table in ``--help``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from tierckpt import errors
from tierckpt.errors import TierckptError

__all__ = ["COMMANDS", "main"]

#: command → module; the order is the order of ``tierckpt --help``. Wings add one line each.
COMMANDS: dict[str, str] = {
    "ls": "tierckpt.commands.ls",
    "show": "tierckpt.commands.show",
    "verify": "tierckpt.commands.verify",
    "promote": "tierckpt.commands.promote",
    "export": "tierckpt.commands.export",
    "gc": "tierckpt.commands.gc",
    "demo": "tierckpt.commands.demo",
    "bench": "tierckpt.commands.bench",
    "agent": "tierckpt.agent.cli",
    "import": "tierckpt.compat.importer",
    "k8s": "tierckpt.deploy.k8s",
}
_HELP_FALLBACK = {
    "tierckpt.agent.cli": "the node agent: serve, status, flush (docs/agent.md)",
    "tierckpt.compat.importer": "convert SageMaker checkpointing steps on S3 to tierckpt steps (docs/compat.md)",
    "tierckpt.deploy.k8s": "Kubernetes: render a HyperPodPyTorchJob as JobSet/PyTorchJob manifests (docs/deploy.md)",
}
_EXIT_CODES = (
    (0, "success"),
    (1, "any other tierckpt error"),
    (2, f"bad arguments or settings ({errors.ConfigError.__name__})"),
    (3, f"no such step or namespace ({errors.CheckpointNotFoundError.__name__})"),
    (4, f"a copy fails its checksums ({errors.IntegrityError.__name__}: verify, ls --verify, promote, export)"),
    (5, f"state dict and checkpoint differ ({errors.StateDictMismatchError.__name__})"),
    (6, f"the memory budget cannot hold a step ({errors.MemoryBudgetError.__name__})"),
    (7, f"storage I/O failed ({errors.StorageError.__name__}: disk, permissions, S3)"),
    (8, f"ranks or peers disagree ({errors.ProtocolError.__name__})"),
    (130, "interrupted (Ctrl-C)"),
)


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("tierckpt")
    except PackageNotFoundError:
        from tierckpt import __version__

        return __version__


def _parser() -> argparse.ArgumentParser:
    from tierckpt.commands.context import add_storage_options

    epilog = "exit codes:\n" + "\n".join(f"  {code:<4} {text}" for code, text in _EXIT_CODES)
    epilog += "\n\n`tierckpt COMMAND --help` explains each command; docs/cli.md has examples."
    p = argparse.ArgumentParser(prog="tierckpt", epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Tiered checkpoints for PyTorch: inspect, verify, promote, export, "
                                            "clean up; the launcher, the node agent, demo and benchmarks.")
    p.add_argument("--version", action="version", version=f"tierckpt {_version()}")
    _add_globals(p, top_level=True)
    add_storage_options(p, top_level=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        text = getattr(module, "HELP", _HELP_FALLBACK.get(module_name, ""))
        c = sub.add_parser(name, help=text, description=text, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(c)
        if getattr(module, "STORAGE", False):
            add_storage_options(c, top_level=False)
            _add_globals(c, top_level=False)
        c.set_defaults(_module=module_name)
    sub.add_parser("run", help="the resilient launcher, a torchrun drop-in (`tierckpt run --help`, docs/launcher.md)",
                   add_help=False)
    return p


def _add_globals(p: argparse.ArgumentParser, *, top_level: bool) -> None:
    default = "auto" if top_level else argparse.SUPPRESS
    p.add_argument("--progress", choices=["auto", "bar", "plain", "none"], default=default,
                   help="progress of long operations on stderr: a bar on a terminal, lines otherwise (auto)")


def _hand_globals_to_wing(args: argparse.Namespace, argv: list[str]) -> None:
    """A wing with its own ``--memory-dir`` (agent) gets the value given before the command too.

    argparse lets the subcommand's default overwrite a top-level value of the same name; a
    value the user typed after the command still wins.
    """
    module = sys.modules.get(args._module)
    if module is None or getattr(module, "STORAGE", False):
        return
    from tierckpt.commands.context import add_storage_options

    pre = argparse.ArgumentParser(add_help=False)
    add_storage_options(pre, top_level=True)
    pre.add_argument("--progress")
    pre.add_argument("command")
    pre.add_argument("rest", nargs=argparse.REMAINDER)
    before, _ = pre.parse_known_args(argv)
    for name in ("namespace", "memory_dir", "durable_url"):
        flag = "--" + name.replace("_", "-")
        given_after = any(t == flag or t.startswith(flag + "=") for t in before.rest)
        if getattr(before, name) is not None and hasattr(args, name) and not given_after:
            setattr(args, name, getattr(before, name))


def main(argv: Sequence[str] | None = None) -> int:
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # torchrun's own parser takes the rest
        from tierckpt.launcher.cli import main as run_main

        code = run_main(argv[1:])
        if as_program:
            _exit_as_decided(code)
        return code
    args = _parser().parse_args(argv)
    _hand_globals_to_wing(args, argv)
    from tierckpt.commands import progress

    progress.MODE = args.progress
    try:
        return int(importlib.import_module(args._module).main(args))
    except TierckptError as exc:
        print(f"tierckpt: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("tierckpt: interrupted", file=sys.stderr)
        return 130


def _exit_as_decided(code: int) -> None:
    """``tierckpt run`` as a program, once it closed its parts: exit with the code it decided (75
    asks the scheduler for a full restart), without the interpreter's finalization (exiting.py)."""
    from tierckpt.launcher.exiting import exit_now

    exit_now(code)


if __name__ == "__main__":
    sys.exit(main())
