"""``--pre-train-script`` / ``--post-train-script`` (``hyperpodrun``'s): one process per node around training.

    scripts = TrainScripts.from_args(pre="prepare.sh", pre_args="--fetch", post=None, post_args="")
    scripts.pre_train(env)       # every (re)start of this node's workers, before they start
    scripts.post_train(env)      # once, after every worker of this node succeeded

Call order (the supervisor): ``pre_train`` in its ``start_workers`` hook, on every node, at the
first start and at every process restart (never for an in-process restart or a one-rank
replacement: those keep the processes); ``post_train`` when the workers succeeded, before the
``exit`` event. Each runs to its end in the foreground (the workers wait for ``pre_train``); a
script that cannot start or exits non-zero raises ``TrainScriptError``, which ends the run with
exit 70 and an ``exit`` event naming it (a failed preparation is not a fault of the workers).

A path ending in ``.py`` runs under this interpreter; anything else is executed as is (it needs
its executable bit, or a ``#!`` line and one). ``*_args`` is one string, split as a shell would
(``shlex``). The script's environment is the agent's, plus ``extra`` (the supervisor passes
``JOB_RESTART_COUNT``, ``TIERCKPT_GENERATION``, ``GROUP_RANK`` and the tiers' variables).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass

from tierckpt.errors import ConfigError, TrainScriptError

__all__ = ["TrainScripts"]


def _argv(option: str, script: str | None, args: str) -> tuple[str, ...]:
    if not script:
        if args:
            raise ConfigError(f"{option}-args given without {option}-script; give the script too, or drop the args")
        return ()
    try:
        extra = shlex.split(args)
    except ValueError as exc:
        raise ConfigError(f"{option}-args {args!r}: {exc}; quote it as a shell would") from None
    head = (sys.executable, script) if script.endswith(".py") else (script,)
    return (*head, *extra)


@dataclass(frozen=True, kw_only=True)
class TrainScripts:
    """The scripts' argv (empty: none)."""

    pre: tuple[str, ...] = ()
    post: tuple[str, ...] = ()

    @classmethod
    def from_args(cls, *, pre: str | None, pre_args: str, post: str | None, post_args: str) -> TrainScripts:
        """From the command line; a script that is not there is a ``ConfigError`` before any worker starts."""
        for option, script in (("--pre-train-script", pre), ("--post-train-script", post)):
            if script and not os.path.isfile(script):
                raise ConfigError(f"{option} {script}: no such file; give the path of the script to run")
        return cls(pre=_argv("--pre-train", pre, pre_args), post=_argv("--post-train", post, post_args))

    def pre_train(self, extra: dict[str, str]) -> float | None:
        """Run the pre-train script (seconds it took; None without one)."""
        return _run("pre_train", self.pre, extra)

    def post_train(self, extra: dict[str, str]) -> float | None:
        """Run the post-train script (seconds it took; None without one)."""
        return _run("post_train", self.post, extra)


def _run(phase: str, argv: tuple[str, ...], extra: dict[str, str]) -> float | None:
    if not argv:
        return None
    t0 = time.monotonic()
    option = "--" + phase.replace("_", "-") + "-script"
    try:
        code = subprocess.run(list(argv), env={**os.environ, **extra}, check=False).returncode
    except OSError as exc:
        raise TrainScriptError(f"{option} {shlex.join(argv)} could not start: {exc.strerror or exc}; make it "
                               "executable (chmod +x, with a #! line) or name a .py file", phase=phase) from None
    if code != 0:
        raise TrainScriptError(f"{option} {shlex.join(argv)} exited with {code}", phase=phase, code=code)
    return time.monotonic() - t0
