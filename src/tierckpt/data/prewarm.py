"""Loaders built ahead of their rank by a warm standby: after a process restart the workers are forked and warm already.

Call order:

  the standby (``tierckpt run --warm-loader MOD:FN``; ``tierckpt.launcher.workers.standby``), after
  its imports and before it reports ready:
      build(["MOD:FN"], argv=[script, *args], close_fds=(sock_fd,))
          imports MOD, calls ``FN(None, None)`` with ``sys.argv`` set to the script's command line,
          and ``start()``s the loader it returns: its workers fork and load a warm-up batch now
      at take-over: ``worker_pids()`` go back to SCHED_OTHER with the standby;
      before a cold ``execve`` (stale code): ``discard()``
  the script, every start (warm or cold), before ``init_process_group`` and the load:
      loader = tierckpt.data.ahead(make_loader)      # rank, world_size: $RANK, $WORLD_SIZE unless given
          the standby's loader for ``make_loader`` bound to the rank (``ResumableLoader.bind``), or
          else ``make_loader(rank, world_size)``, ``start()``ed
      state = {"model": ..., "data": tierckpt.data.item(loader)}; ck.load(state)
          the item repositions the loader as soon as its position is read, before the model's
          tensors, and the workers load the position's first batches while the rest loads

The factory, ``make_loader(rank, world_size) -> ResumableLoader``, is a module-level function of an
importable module (the script itself, guarded by ``if __name__ == "__main__":``, or a module beside
it); a standby and the script find the same one by its source file and name. In the standby both
arguments are None: a ``ResumableLoader`` built with neither waits for ``bind`` (its workers hold
the dataset; the rank goes to the sampler, in the training process). So the dataset must not
depend on the rank: a factory that uses the rank otherwise fails in the standby (reported on its
stderr, skipped) and the script builds its loader itself, cold: correct, only slower. The factory
reads its settings from ``sys.argv`` (the script's own arguments) or the environment, as the
script would.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tierckpt import workerenv
from tierckpt.data.loader import _AHEAD, ResumableLoader
from tierckpt.errors import ConfigError

__all__ = ["AheadReport", "ahead", "build", "discard", "last", "parse_spec", "worker_pids"]

Factory = Callable[[Any, Any], ResumableLoader]

#: loaders the standby built, by their factory's (source file, qualified name)
_BUILT: dict[tuple[str, str], ResumableLoader] = {}
#: what the standby could not build: one line each (``ahead`` says it in its report)
_PROBLEMS: list[str] = []


@dataclass(frozen=True)
class AheadReport:
    """What the latest ``ahead`` call did: ``warm`` (the standby's loader, bound) or not, and why not."""

    warm: bool
    why: str
    worker_pids: tuple[int, ...]


_LAST: list[AheadReport] = []


def last() -> AheadReport | None:
    """The latest ``ahead`` call's report (None before the first)."""
    return _LAST[-1] if _LAST else None


def parse_spec(spec: str) -> tuple[str, str]:
    """``"pkg.mod:make_loader"`` → (module, function); a ConfigError for anything else."""
    parts = workerenv.split_loader_spec(spec)
    if parts is None:
        raise ConfigError(f"--warm-loader wants MODULE:FUNCTION (e.g. train:make_loader), got {spec!r}")
    return parts


def _key(fn: Any) -> tuple[str, str] | None:
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", None)
    if code is None or not isinstance(name, str):
        return None
    return os.path.realpath(code.co_filename), name


def build(specs: Sequence[str], *, argv: Sequence[str] | None = None, close_fds: tuple[int, ...] = ()) -> list[str]:
    """Build and start each ``MODULE:FUNCTION``'s loader (a standby, before it reports ready);
    returns one line per loader that could not be built (the script will build it cold)."""
    problems = []
    saved_argv = sys.argv
    for spec in specs:
        try:
            mod, name = parse_spec(spec)
            fn: Any = importlib.import_module(mod)
            for part in name.split("."):
                fn = getattr(fn, part)
            key = _key(fn)
            if key is None:
                raise ConfigError(f"{spec} is not a Python function")
            if argv is not None:
                sys.argv = list(argv)
            _AHEAD.building, _AHEAD.close_fds = True, close_fds
            try:
                loader = fn(None, None)
            finally:
                _AHEAD.building, _AHEAD.close_fds = False, ()
                sys.argv = saved_argv
            if not isinstance(loader, ResumableLoader) or loader.bound:
                raise ConfigError(f"{spec} returned {type(loader).__name__}"
                                  + (" bound to a rank" if isinstance(loader, ResumableLoader) else "")
                                  + ": a warm standby builds a tierckpt.data.ResumableLoader given neither rank "
                                    "nor world_size (its factory passes the None it gets)")
            loader.start()
            _BUILT[key] = loader
        except Exception as exc:  # noqa: BLE001 - the script builds it cold; the standby reports this
            problems.append(f"{spec}: {type(exc).__name__}: {exc}")
    _PROBLEMS.extend(problems)
    return problems


def worker_pids() -> list[int]:
    """The worker processes of every loader built ahead and not yet taken."""
    return [pid for loader in _BUILT.values() for pid in loader.worker_pids()]


def discard() -> None:
    """Stop the workers of every loader built ahead (a standby about to ``execve`` its cold command)."""
    for loader in _BUILT.values():
        it = getattr(loader._loader, "_iterator", None)
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
    _BUILT.clear()
    _PROBLEMS.clear()


def _env_int(name: str) -> int:
    raw = os.environ.get(name)
    try:
        return int(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"tierckpt.data.ahead needs rank= and world_size=, or ${name} set (tierckpt run and "
                          f"torchrun set it); got {name}={raw!r}") from None


def ahead(factory: Factory, *, rank: int | None = None, world_size: int | None = None) -> ResumableLoader:
    """The loader ``factory`` builds for this rank, its workers started: the one a warm standby
    built ahead (``--warm-loader``), bound to the rank, when there is one; else a new one."""
    rank = _env_int("RANK") if rank is None else rank
    world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
    key = _key(factory)
    loader = _BUILT.pop(key, None) if key is not None else None
    if loader is not None:
        loader.bind(rank, world_size)
        _LAST.append(AheadReport(True, "built ahead by the warm standby", tuple(loader.worker_pids())))
        return loader
    if _PROBLEMS:
        why = "the warm standby could not build it: " + "; ".join(_PROBLEMS)
    elif _BUILT:
        why = f"the standby built {sorted(n for _, n in _BUILT)}, not {getattr(factory, '__qualname__', factory)!r}"
    else:
        why = "no warm standby built it (a cold start, or no --warm-loader for it)"
    loader = factory(rank, world_size)
    if not isinstance(loader, ResumableLoader):
        raise ConfigError(f"tierckpt.data.ahead: the factory returned {type(loader).__name__}, not a ResumableLoader")
    loader.start()
    _LAST.append(AheadReport(False, why, tuple(loader.worker_pids())))
    return loader
