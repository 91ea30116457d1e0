"""Loading a step through DCP: the agreed newest loadable step, falling back past bad copies.

Call order (every rank, same order, same arguments): ``Loader.load(state_dict, step)`` after
the caller waited for its own saves. Global mode: one ``dcp.load`` with a
``TieredStorageReader`` that agrees on a step across ranks; an integrity failure of the
newest step retries with that step excluded. Local mode: ranks agree on a step every rank
holds (``localmode.agree``), each reads only its own shards, and all confirm together.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from tierckpt import guard, layout, localmode, metrics
from tierckpt._torch_compat import flatten_state_dict
from tierckpt.config import CheckpointConfig
from tierckpt.dcp.reader import TieredStorageReader
from tierckpt.errors import CheckpointNotFoundError, IntegrityError, NoUsableStepError, StateDictMismatchError
from tierckpt.observability import StepLogger
from tierckpt.runtime import RankRuntime
from tierckpt.snapshot import resolve_stateful

__all__ = ["EarlyPlanner", "Loader", "quiet_dcp_fallback"]


class Loader:
    """Loads for one ``Checkpointer``; ``last_load`` describes the latest successful load."""

    def __init__(self, config: CheckpointConfig, runtime: RankRuntime, log: StepLogger, *,
                 group: dist.ProcessGroup | None, agree_group: dist.ProcessGroup | None) -> None:
        self.config = config
        self.runtime = runtime
        self.log = log
        self.group = group  # the training group: global-mode DCP collectives
        self.agree_group = agree_group  # local mode: the side group of the agreement
        self.last_load: dict[str, Any] = {}

    def load(self, state_dict: dict[str, Any], step: int | None, *, strict: bool = False,
             trusted: bool | None = None, resume_before: int | None = None) -> int | None:
        """Load the newest loadable step (or ``step``) in place; None when nothing exists.

        Steps that exist but that no rank set can load raise NoUsableStepError; without
        ``step``, ``resume_before`` (the launcher's, after a non-finite loss; the caller
        decides whether it applies, the same on every rank) bounds the step from above.
        """
        checks: dict[str, Any] = {"strict": strict, "trusted": trusted, "verify_ahead": False}  # checked while read
        before = resume_before if step is None else None
        if before is not None:
            self.log.warning(None, "resume_before=%d (TIERCKPT_RESUME_BEFORE, set by tierckpt run after a non-finite "
                             "loss at step %d): loading the newest step older than %d, not a newer one the "
                             "non-finite values may have reached", before, before, before)
        loaded = self._load_local(state_dict, step, checks, before) if self.config.local_mode else \
            self._load_global(state_dict, step, checks, before)
        if loaded is None and before is not None:
            self.log.warning(None, "no committed step older than %d exists (resume_before): starting from scratch",
                             before)
        return loaded

    def _load_global(self, state_dict: dict[str, Any], step: int | None, checks: dict[str, Any],
                     before: int | None) -> int | None:
        """Global mode: one ``dcp.load`` per try; a damaged newest step retries with it excluded."""
        excluded: list[int] = []
        failures: list[tuple[int, str]] = []
        config = self.config if self.config.resume_before == before else self.config.replace(resume_before=before)
        while True:
            reader = TieredStorageReader(
                config, step, process_group=self.group, exclude_steps=excluded,
                expect=state_dict, _runtime=self.runtime, **checks,
            )
            t0 = time.perf_counter()
            try:
                with warnings.catch_warnings(), quiet_dcp_fallback():
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp_load(state_dict, storage_reader=reader, process_group=self.group,
                             planner=_planner_for(state_dict))
            except CheckpointException as exc:
                err = reader.failure or guard.typed(exc)  # the first tierckpt error inside DCP's wrapper
                if isinstance(err, NoUsableStepError):  # steps exist, none for every rank: never "fresh"
                    raise err from err.__cause__
                if isinstance(err, CheckpointNotFoundError) and step is None and not excluded:
                    self.log.info(None, "no checkpoint found; starting fresh")
                    return None
                if isinstance(err, CheckpointNotFoundError) and excluded:  # every step there was failed
                    raise IntegrityError("no step loads: " + "; ".join(f"step {s}: {r}" for s, r in failures)) from err
                if isinstance(err, IntegrityError) and step is None and reader.step is not None:
                    self.log.warning(reader.step, "failed to load (%s); trying an older step", err)
                    excluded.append(reader.step)
                    failures.append((reader.step, f"failed to load: {err}"))
                    continue
                raise err from err.__cause__
            self.last_load = {
                "step": reader.step, "seconds": time.perf_counter() - t0,
                "tiers": sorted(set(reader.tiers_used.values())),
                "skipped": failures + [tuple(s) for s in reader.skipped],  # (step, reason) pairs
            }
            metrics.loaded(self)
            self.log.info(reader.step, "loaded in %.3fs from %s", self.last_load["seconds"], self.last_load["tiers"])
            return reader.step

    def _load_local(self, state_dict: dict[str, Any], step: int | None, checks: dict[str, Any],
                    before: int | None) -> int | None:
        """Local mode: agree on a step every rank holds, then each rank reads only its own shards."""
        local_sd = localmode.localize(state_dict)
        excluded: set[int] = set()
        while True:
            chosen = localmode.agree(self.runtime, self.config, step, excluded, self.agree_group,
                                     before=before)
            if chosen is None:
                if excluded:
                    raise IntegrityError(f"no step loads on every rank; failed: {sorted(excluded)}")
                self.log.info(None, "no checkpoint found; starting fresh")
                return None
            reader = TieredStorageReader(self.runtime.config, chosen, expect=local_sd, single_process=True,
                                         _runtime=self.runtime, **checks)
            t0, error = time.perf_counter(), None
            try:
                with warnings.catch_warnings(), quiet_dcp_fallback():
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp_load(local_sd, storage_reader=reader, no_dist=True,
                             planner=_planner_for(state_dict, partial_ok=False))
            except CheckpointException as exc:
                error = reader.failure or guard.typed(exc)
            if localmode.confirm(error is None, self.agree_group):
                self.last_load = {"step": chosen, "seconds": time.perf_counter() - t0,
                                  "tiers": sorted(set(reader.tiers_used.values())),
                                  "skipped": [(s, "failed to load on some rank") for s in sorted(excluded)]}
                localmode.write_back(state_dict, local_sd)
                metrics.loaded(self)
                return chosen
            if step is not None or isinstance(error, (StateDictMismatchError,)):
                raise error if error is not None else IntegrityError(f"step {chosen} failed to load on another rank", step=chosen)
            self.log.warning(chosen, "failed to load on some rank (%s); trying an older step", error)
            excluded.add(chosen)


def _planner_for(state_dict: dict[str, Any], *, partial_ok: bool = True) -> DefaultLoadPlanner | None:
    """DCP's planner, told that a per-rank item may be absent (``layout.is_rank_item``): a rank of a
    larger world than the saving one has none, and its owner falls back (``tierckpt.data``). Every
    other key the checkpoint lacks is still an error (``matching.check_expected``). Top-level
    entries with a ``load_early`` method (``tierckpt.data.LoaderItem``) get it called as soon as
    their entries were read (``EarlyPlanner``). ``partial_ok=False`` (local mode: each rank reads
    its own step) never allows a partial load."""
    early = {k: v for k, v in state_dict.items() if callable(getattr(v, "load_early", None))}
    if not partial_ok:
        return EarlyPlanner(early) if early else None
    flat, _ = flatten_state_dict(resolve_stateful(state_dict))
    partial = any(layout.is_rank_item(k) for k in flat)
    if early:
        return EarlyPlanner(early, allow_partial_load=partial)
    if not partial:
        return None
    return DefaultLoadPlanner(allow_partial_load=True)


class EarlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner that hands each early entry (a top-level key whose object has
    ``load_early``) its entries the moment the last of them was read, before the rest of the
    plan's reads finish (``dcp.items.ItemReader`` reads byte items first). DCP still calls the
    object's ``load_state_dict`` with the same entries at the end.

    Call order (DCP): ``set_up_planner`` → ``create_local_plan`` (which of the early entries'
    fqns this rank reads) → ``load_bytes``/``commit_tensor`` per item (``load_early`` from there).
    """

    def __init__(self, early: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.early = early
        self._waiting: dict[str, set[str]] = {}

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        self._waiting = {}
        for req in plan.items:
            top = self._top(req.dest_index.fqn)
            if top in self.early:
                self._waiting.setdefault(top, set()).add(req.dest_index.fqn)
        return plan

    def _top(self, fqn: str) -> str:
        path = self.mappings.get(fqn) if self.flatten_state_dict else None
        return str(path[0]) if path else fqn.split(".", 1)[0]

    def load_bytes(self, read_item: Any, value: Any) -> None:
        super().load_bytes(read_item, value)
        fqn = read_item.dest_index.fqn
        top = self._top(fqn)
        waiting = self._waiting.get(top)
        if waiting is None or fqn not in waiting:
            return
        waiting.discard(fqn)
        if not waiting:
            del self._waiting[top]
            self.early[top].load_early(self.original_state_dict[top])


@contextlib.contextmanager
def quiet_dcp_fallback() -> Iterator[None]:
    """DCP logs a traceback when read_metadata raises; tierckpt reports that error itself."""
    dcp_logger = logging.getLogger()  # DCP's state_dict_loader logs on the root logger

    def drop(record: logging.LogRecord) -> bool:
        return "metadata is not found" not in record.getMessage()

    dcp_logger.addFilter(drop)
    try:
        yield
    finally:
        dcp_logger.removeFilter(drop)
