"""Committing a step on the nodes other than the coordinator's, under plain ``dcp.save``.

DCP runs ``finish`` on the coordinator only, so no hook runs afterwards on other nodes.
The coordinator therefore publishes the step's ``.metadata`` and manifest in the job's
c10d store, and one rank per other node waits for them in a daemon thread and commits
its node's memory tier (which already holds the node's data files in staging).
``Checkpointer`` does not need this: it broadcasts on its own commit group instead.

Call order: write_data (node leader) → ``await_publication`` starts the waiter;
finish (coordinator) → ``publish``; the waiter → ``LocalTier.commit`` + retention.
If the store cannot be reached or the coordinator never publishes, the waiter drops the
staged files (freeing the slot) and logs why: that node then has no memory copy of the step.
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any

import torch.distributed as dist

from tierckpt import layout
from tierckpt.errors import ProtocolError, TierckptError
from tierckpt.observability import StepLogger
from tierckpt.runtime import RankRuntime

__all__ = ["await_publication", "publish", "raise_background_error"]

WAIT_S = 900.0


def _store() -> Any | None:
    """The default process group's store; a private torch API, hence the guard."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except (RuntimeError, ValueError):
        return None


def _key(rt: RankRuntime, save_id: str) -> str:
    return f"tierckpt/{rt.config.namespace}/commit/{save_id}"


def publish(rt: RankRuntime, step: int, save_id: str, md: bytes, mf: bytes, log: StepLogger) -> None:
    store = _store()
    if store is None:
        log.warning(step, "no c10d store: other nodes cannot commit this step in their memory tier")
        return
    store.set(_key(rt, save_id), len(md).to_bytes(8, "little") + md + mf)
    # the previous publication has been read by now (its waiters committed before this save began)
    previous = rt.published_key
    if previous is not None:
        try:
            store.delete_key(previous)
        except (RuntimeError, AttributeError):
            pass
    rt.published_key = _key(rt, save_id)


def await_publication(rt: RankRuntime, step: int, save_id: str, log: StepLogger) -> None:
    store = _store()
    if store is None:
        rt.memory.abort(step, save_id)
        log.warning(step, "no c10d store: this node keeps no memory copy of the step")
        return

    def wait_and_commit() -> None:
        key = _key(rt, save_id)
        try:
            store.wait([key], datetime.timedelta(seconds=WAIT_S))
            raw = store.get(key)
            n = int.from_bytes(raw[:8], "little")
            rt.memory.commit(step, save_id, {layout.METADATA: raw[8 : 8 + n], layout.MANIFEST: raw[8 + n :]})
            rt.committed_in_memory(step)
            rt.apply_retention(rt.memory, rt.memory_retention)
            log.info(step, "Committed to this node's memory (%s)", rt.memory.location(step))
        except (dist.DistError, TierckptError, OSError) as exc:
            # expected: the save failed elsewhere (no publication in time), the store went away
            # with the job, or this node's tier failed; the node keeps no memory copy of the step
            _abort(rt, step, save_id, log)
            log.warning(step, "this node's memory copy was not committed: %s", exc)
        except BaseException as exc:
            # a bug, not a fault: drop the staged copy, keep the error for this rank's next save
            # (which raises it as ProtocolError) and let the thread's excepthook print it
            _abort(rt, step, save_id, log)
            rt.background_errors.append(exc)
            log.log(logging.ERROR, step, "committing this node's memory copy failed unexpectedly: %r", exc)
            raise

    threading.Thread(target=wait_and_commit, name=f"tierckpt-node-commit-{step}", daemon=True).start()


def _abort(rt: RankRuntime, step: int, save_id: str, log: StepLogger) -> None:
    try:
        rt.memory.abort(step, save_id)
    except (TierckptError, OSError) as exc:  # garbage collection of staging retries it later
        log.warning(step, "could not drop the staged copy: %s", exc)


def raise_background_error(rt: RankRuntime, step: int) -> None:
    """Raise (once) a programming error a node-commit thread of this rank hit; call before a save."""
    if rt.background_errors:
        exc = rt.background_errors.pop(0)
        raise ProtocolError(
            f"a background commit of an earlier step failed with {type(exc).__name__}: {exc} "
            "(a bug in tierckpt or in code it calls; please report it with the traceback above)",
            tier="memory", step=step,
        ) from exc
