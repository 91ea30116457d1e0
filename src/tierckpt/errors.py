"""Errors raised by tierckpt: one root, context as attributes, an exit code for the CLI.

    TierckptError                      root; every error tierckpt raises derives from it
    ├── ConfigError (ValueError)       a bad setting: namespace, URL, step, budget field
    ├── CheckpointNotFoundError (FileNotFoundError)
    │   │                              the asked-for step does not exist in any tier
    │   └── NoUsableStepError          committed steps exist, but none every rank can load
    ├── IntegrityError                 a copy failed its checksum and no good copy is left
    │   └── SnapshotChangedError       an overlapped save's source changed before its copy (debug mode)
    ├── StateDictMismatchError (ValueError)
    │   │                              the state dict does not match the checkpoint
    │   └── LoaderStateMismatchError   a data loader's saved position does not fit this loader
    │                                  (another dataset length, seed, order; a state not reshardable)
    ├── UnsaveableObjectError (TypeError)
    │                                  a state dict value cannot be serialized (a lock, a lambda)
    ├── UnsafeObjectError              a checkpoint object is outside the load allow-list (trusted=True opts in)
    ├── MemoryBudgetError (MemoryError)
    │                                  the memory tier cannot hold one step
    ├── StorageError (OSError)         a tier's I/O failed (disk full, permission, network)
    │   └── DurableWriteError          the durable copy of a step failed; memory is intact
    ├── ProtocolError                  peers disagree (world size, save ids) or broke the call order
    ├── NonFiniteLossError             a save was held back: the loss was non-finite (monitor.step);
    │                                  Checkpointer reports it as SaveHandle.skipped, not as a failure
    ├── CheckpointFailedError          DCP's CheckpointException (a BaseException), made catchable
    ├── RestartRequested               the step was left for an in-process restart (tierckpt.resilient)
    ├── InProcessRestartError          an in-process restart cannot go on: restarts used up, a rank gone
    └── TrainScriptError               tierckpt run's --pre-train-script / --post-train-script failed
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AgentRunningError",
    "CheckpointFailedError",
    "CheckpointNotFoundError",
    "ConfigError",
    "DurableWriteError",
    "InProcessRestartError",
    "IntegrityError",
    "LoadMismatchWarning",
    "LoaderStateMismatchError",
    "MemoryBudgetError",
    "NoUsableStepError",
    "NonFiniteLossError",
    "ProtocolError",
    "RestartRequested",
    "SnapshotChangedError",
    "StateDictMismatchError",
    "StorageError",
    "TierckptError",
    "TrainScriptError",
    "UnsafeObjectError",
    "UnsaveableObjectError",
]


class TierckptError(Exception):
    """Root of every error tierckpt raises.

    Context travels as attributes (``tier``, ``path``, ``rank``, ``step``) so callers
    need not parse messages; ``exit_code`` is what the ``tierckpt`` command returns.
    """

    exit_code = 1

    def __init__(
        self,
        message: str,
        *,
        tier: str | None = None,
        path: str | None = None,
        rank: int | None = None,
        step: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.tier = tier
        self.path = path
        self.rank = rank
        self.step = step

    def __reduce__(self) -> tuple[object, ...]:  # keep context across processes (DCP gathers errors)
        return (
            _rebuild,
            (type(self), self.message, self.tier, self.path, self.rank, self.step),
        )

    def __str__(self) -> str:
        return self.message


def _rebuild(
    cls: type[TierckptError], message: str, tier: str | None, path: str | None, rank: int | None, step: int | None
) -> TierckptError:
    return cls(message, tier=tier, path=path, rank=rank, step=step)


class ConfigError(TierckptError, ValueError):
    """A setting is invalid; the message names the field and the fix."""

    exit_code = 2


class CheckpointNotFoundError(TierckptError, FileNotFoundError):
    """The asked-for step does not exist in any tier."""

    exit_code = 3


class NoUsableStepError(CheckpointNotFoundError):
    """Committed steps exist (in a memory root, under other ranks' names, or in another tier),
    but no step is complete for every rank; nothing was loaded.

    Raised by a load without an explicit step instead of returning ``None`` (which means "no
    checkpoint at all": start fresh). ``steps`` are the committed steps found anywhere, oldest
    first; ``missing`` maps each of them to what keeps some rank from loading it. The message
    says which rank holds what and what to do (same ranks on the same nodes, ``--replicas 1``,
    a durable tier).
    """

    def __init__(self, message: str, *, steps: tuple[int, ...] = (), missing: dict[int, str] | None = None,
                 **context: Any) -> None:
        super().__init__(message, **context)
        self.steps = tuple(steps)
        self.missing: dict[int, str] = dict(missing or {})

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_unusable, (self.message, self.steps, self.missing, self.rank))


def _rebuild_unusable(message: str, steps: tuple[int, ...], missing: dict[int, str], rank: int | None) -> NoUsableStepError:
    return NoUsableStepError(message, steps=steps, missing=missing, rank=rank)


class IntegrityError(TierckptError):
    """A stored copy failed verification and no good copy remains."""

    exit_code = 4


class StateDictMismatchError(TierckptError, ValueError):
    """The state dict given to load does not match what the checkpoint holds."""

    exit_code = 5


class LoaderStateMismatchError(StateDictMismatchError):
    """A data loader's saved position (``tierckpt.data``) does not fit the loader it is restored into.

    ``field`` names what differs (``length``, ``seed``, ``shuffle``, ``drop_last``, ``rank``,
    ``world_size``, ``kind``); ``saved`` and ``current`` are its two values.
    """

    def __init__(self, message: str, *, field: str, saved: Any = None, current: Any = None,
                 **context: Any) -> None:
        super().__init__(message, **context)
        self.field = field
        self.saved = saved
        self.current = current

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_loader_mismatch, (self.message, self.field, self.saved, self.current, self.rank, self.step))


def _rebuild_loader_mismatch(message: str, field: str, saved: Any, current: Any, rank: int | None,
                             step: int | None) -> LoaderStateMismatchError:
    return LoaderStateMismatchError(message, field=field, saved=saved, current=current, rank=rank, step=step)


class MemoryBudgetError(TierckptError, MemoryError):
    """The memory tier cannot hold one step within its budget."""

    exit_code = 6


class StorageError(TierckptError, OSError):
    """A tier's I/O failed."""

    exit_code = 7


class DurableWriteError(StorageError):
    """The durable copy failed; the memory copy of the same step is intact."""


class AgentRunningError(StorageError):
    """A node agent already serves this memory root (its ``.agent.sock`` answers); one root has
    one agent. A launcher that finds one uses it instead of hosting its own."""


class ProtocolError(TierckptError):
    """Ranks disagree with each other, or an interface was called out of order."""

    exit_code = 8


class NonFiniteLossError(TierckptError):
    """A save was not committed because ``tierckpt.monitor.step`` reported a non-finite loss.

    Raised inside the commit (on any rank: the save is then committed nowhere);
    ``Checkpointer.save`` turns it into ``SaveHandle.skipped`` (the reason) and a warning, so
    a training loop keeps running until the launcher restarts it from an older step.
    """


class UnsaveableObjectError(TierckptError, TypeError):
    """A state dict value cannot be serialized; ``key`` names it (dotted, as DCP flattens it)."""

    exit_code = 5

    def __init__(self, message: str, *, key: str | None = None, **context: Any) -> None:
        super().__init__(message, **context)
        self.key = key


class CheckpointFailedError(TierckptError):
    """A DCP collective failed on some rank with an error that is not tierckpt's own.

    DCP reports such failures as ``CheckpointException``, which derives from ``BaseException``
    (so ``except Exception`` misses it); this carries it, chained as ``__cause__``, and
    ``failures`` maps each failed rank to its error.
    """

    def __init__(self, message: str, *, failures: dict[int, BaseException] | None = None, **context: Any) -> None:
        super().__init__(message, **context)
        self.failures: dict[int, BaseException] = dict(failures or {})


class SnapshotChangedError(IntegrityError):
    """An overlapped save's tensor changed before its copy landed (``check_snapshot=True``).

    ``key`` names the tensor (its flattened state-dict key); the step was not committed.
    """

    def __init__(self, message: str, *, key: str, step: int | None = None) -> None:
        super().__init__(message, tier="memory", step=step)
        self.key = key

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_changed, (self.message, self.key, self.step))


def _rebuild_changed(message: str, key: str, step: int | None) -> SnapshotChangedError:
    return SnapshotChangedError(message, key=key, step=step)


class UnsafeObjectError(TierckptError):
    """A checkpoint object references a class or function outside the load allow-list.

    ``names`` lists the refused globals as ``module.name``. Not an integrity problem: every copy
    of the step holds the same object, so no fallback to another tier or an older step happens.
    """

    exit_code = 4

    def __init__(self, message: str, *, names: tuple[str, ...] = (), **context: Any) -> None:
        super().__init__(message, **context)
        self.names = names


class LoadMismatchWarning(UserWarning):
    """A load cast tensors to the state dict's dtypes or left checkpoint keys unloaded.

    Not an error: DCP's behaviour, kept; ``load(..., strict=True)`` makes both a
    ``StateDictMismatchError`` instead.
    """


class RestartRequested(TierckptError):
    """Raised in a rank's main thread to leave the step: a fault here or elsewhere (``reason``).

    ``tierckpt.resilient`` catches it and restarts in-process; outside the wrapper it is never raised.
    """

    def __init__(self, reason: str, *, step: int | None = None) -> None:
        super().__init__(f"in-process restart: {reason}" + (f" at step {step}" if step is not None else ""),
                         step=step)
        self.reason = reason


class InProcessRestartError(TierckptError):
    """An in-process restart cannot go on (restarts used up, a rank did not rejoin): let the
    launcher restart the processes."""

    exit_code = 9

    def __init__(self, message: str, *, generation: int) -> None:
        super().__init__(message)
        self.generation = generation


class TrainScriptError(TierckptError):
    """``tierckpt run --pre-train-script`` (before a generation's workers start) or
    ``--post-train-script`` (after they all succeeded) could not run or exited non-zero;
    ``phase`` is ``pre_train`` or ``post_train``, ``code`` the exit status (None: it did not start)."""

    def __init__(self, message: str, *, phase: str = "", code: int | None = None, **context: Any) -> None:
        super().__init__(message, **context)
        self.phase = phase
        self.code = code
