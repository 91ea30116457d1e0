"""``TieredStorageReader``: a PyTorch DCP StorageReader that reads the best verified copy.

Call order (driven by ``dcp.load``, every rank):
  reset(checkpoint_id)? → read_metadata()          lists this rank's tiers, agrees on one step
                                                    with every rank (one all_gather), returns
                                                    that step's verified DCP Metadata
  → set_up_storage_reader(metadata, is_coordinator) → prepare_local_plan → [coordinator]
  prepare_global_plan → read_data(plan, planner)    per file: the memory tier first, then peers
                                                    (through this node's agent, when one runs),
                                                    then durable;
                                                    every item's checksum is checked before its
                                                    bytes reach a tensor; a bad copy falls back
                                                    to the next tier; none good → IntegrityError
After ``dcp.load`` returns, ``step`` and ``tiers_used`` tell what was loaded from where.
"""

from __future__ import annotations

import dataclasses
import io
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor
from torch.futures import Future

from tierckpt import layout
from tierckpt._torch_compat import flatten_state_dict
from tierckpt.config import CheckpointConfig
from tierckpt.dcp.agree import Availability, choose_step, gather
from tierckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    IntegrityError,
    StateDictMismatchError,
    StorageError,
    TierckptError,
)
from tierckpt.integrity import fetch_file, sealed_manifest, verified_metadata, verify_items
from tierckpt.observability import StepLogger, throughput
from tierckpt.record import loads_metadata
from tierckpt.runtime import RankRuntime, runtime_for
from tierckpt.snapshot import resolve_stateful
from tierckpt.tiers import Tier
from tierckpt.tiers.peer import open_peer

__all__ = ["TieredStorageReader"]


class TieredStorageReader(StorageReader):
    """Load a checkpoint saved by tierckpt (or any DCP checkpoint in tierckpt's layout).

    ``step=None`` loads the newest step every rank can load completely (older steps are
    used, with a warning, when newer ones are damaged); an explicit step loads that step
    or raises CheckpointNotFoundError / IntegrityError. ``path`` may name the step as
    ``.../step_N``. ``process_group`` must be the group given to ``dcp.load``.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        step: int | None = None,
        path: str | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        exclude_steps: Iterable[int] = (),
        expect: dict[str, Any] | None = None,
        single_process: bool = False,
        _runtime: RankRuntime | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, CheckpointConfig):
            raise ConfigError("config must be a tierckpt.CheckpointConfig")
        self.config = config
        self.requested = layout.validate_step(step) if step is not None else None
        if self.requested is None and path is not None:
            self.requested = layout.step_from_path(path)
        self.group = process_group
        self.exclude = frozenset(exclude_steps)
        self.expect = expect
        #: with ``single_process`` (dcp.load(..., no_dist=True)) this reader neither gathers nor
        #: takes the process's rank: it reads one rank's own checkpoint as rank 0
        self.single_process = single_process
        distributed = dist.is_available() and dist.is_initialized() and not single_process
        self.rank = dist.get_rank(process_group) if distributed else 0
        self._runtime = _runtime
        self.step: int | None = None
        self.skipped: tuple[tuple[int, str], ...] = ()
        self.tiers_used: dict[str, str] = {}  # file → tier name it was read from
        self._in_memory: frozenset[str] = frozenset()
        self._in_peer: frozenset[str] = frozenset()
        self._peer: Tier | None = None
        self._manifests: dict[tuple[str, int], layout.Manifest] = {}  # sealed, per (tier, step)
        self._metadata_raw: dict[tuple[str, int], bytes] = {}  # verified .metadata, per (tier, step)
        self._manifest: layout.Manifest | None = None
        self._records: dict[tuple[str, int], layout.ItemRecord] = {}
        self._verified: set[tuple[str, int, str, str]] = set()  # (tier, step, file, save id) checked whole
        self._views: dict[tuple[str, int, str], memoryview] = {}  # files fetched during this load
        self._bad: set[tuple[str, int, str]] = set()  # copies already found damaged
        self._storage_data: dict[MetadataIndex, Any] = {}
        self._chunks: dict[MetadataIndex, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._log = StepLogger("reader", self.rank, config.logger)
        #: the tierckpt error this reader raised, if any (DCP re-wraps read_metadata errors)
        self.failure: TierckptError | None = None

    @property
    def runtime(self) -> RankRuntime:
        if self._runtime is None:
            self._runtime = runtime_for(self.config, self.rank)
        return self._runtime

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return layout.step_from_path(checkpoint_id) is not None

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None and self.requested is None:
            self.requested = layout.step_from_path(checkpoint_id)

    # -- choosing the step ----------------------------------------------------------
    def read_metadata(self) -> Metadata:  # no **kwargs: tierckpt keeps global metadata only
        try:
            return self._read_metadata()
        except TierckptError as exc:
            self.failure = exc
            raise

    def _read_metadata(self) -> Metadata:
        rt = self.runtime
        local = self._local_availability(rt)
        everyone = self._gather(local)
        while True:  # every rank runs the same rounds: the choice and the verdicts are shared
            choice = choose_step(everyone, self.requested, namespace=self.config.namespace)
            if choice is None:
                raise CheckpointNotFoundError(
                    f"namespace {self.config.namespace!r} has no checkpoint in any tier"
                )
            self._in_memory = local.memory.get(choice.step, frozenset())
            self._in_peer = local.peer.get(choice.step, frozenset())
            verdicts = self._gather(self._preverify(rt, choice.step))
            failed = [v for v in verdicts if v]
            if not failed:
                break
            everyone = [_demote(a, choice.step, "; ".join(failed)) for a in everyone]
            local = _demote(local, choice.step, "; ".join(failed))
        self.step, self.skipped = choice.step, choice.skipped
        for step, reason in self.skipped:
            self._log.warning(step, "skipped: %s; loading step %d instead", reason, choice.step)
        metadata = self._read_verified_metadata(rt, choice.step)
        if self.expect is not None:
            _check_state_dict(self.expect, metadata, choice.step)
        return metadata

    def _local_availability(self, rt: RankRuntime) -> Availability:
        """What this rank can load: memory steps whose seal and metadata check out; on rank 0
        the durable steps, the newest of them with its seal and metadata checked."""
        memory: dict[int, frozenset[str]] = {}
        files: dict[int, frozenset[str]] = {}
        bad: dict[int, str] = {}
        listings = [s for s in rt.memory.list_steps() if s.step not in self.exclude]
        for listing in sorted(listings, key=lambda s: s.step, reverse=True):
            if self.requested is not None and listing.step != self.requested:
                continue
            try:
                manifest = self._sealed_manifest(rt.memory, listing.step)
                present = frozenset(
                    n for n, size in manifest.files.items() if listing.files.get(n) == size
                )
                self._check_metadata(rt.memory, manifest)
            except (IntegrityError, StorageError, CheckpointNotFoundError) as exc:
                bad[listing.step] = f"memory copy rejected ({exc})"
                continue
            memory[listing.step] = present
            files[listing.step] = frozenset(manifest.files)
        peer = self._peer_availability(rt, files)
        durable, durable_error = None, None
        if self.rank == 0 and rt.durable is not None:
            try:
                durable = self._durable_candidates(rt.durable)
            except StorageError as exc:
                self._log.warning(None, "durable tier unavailable, using memory only: %s", exc)
                durable, durable_error = frozenset(), str(exc)
        return Availability(self.rank, memory, files, durable, bad, durable_error, peer)

    def _peer_availability(self, rt: RankRuntime, files: dict[int, frozenset[str]]) -> dict[int, frozenset[str]]:
        """Files of each step that this node's agent can fetch from peers (none without an agent)."""
        peer = open_peer(rt.config.memory_dir, rt.config.namespace)
        self._peer = peer
        if peer is None:
            return {}
        try:
            catalog = peer.catalog()
        except (StorageError, ValueError, KeyError, TypeError) as exc:
            self._log.warning(None, "the node agent cannot list peers, loading without them: %s", exc)
            self._peer = None
            return {}
        out: dict[int, frozenset[str]] = {}
        for step, entry in catalog.items():
            if step in self.exclude or (self.requested is not None and step != self.requested):
                continue
            out[step] = frozenset(entry.held)
            if step not in files and entry.all_files:
                files[step] = entry.all_files
        return out

    def _gather(self, value: Any) -> list[Any]:
        return [value] if self.single_process else gather(value, self.group)

    def _preverify(self, rt: RankRuntime, step: int) -> str | None:
        """Check this rank's share of the step's files before anyone reads: None if all good.

        The share is every file ``__k_*`` with ``k % world_size == rank``, so together the
        ranks check every file whatever the world size was at save time. Each file is
        checked in the tier this rank would read it from, falling back to the next tier; the
        fetched copies are kept for ``read_data``. A file no tier holds a good copy of makes
        the step unloadable, and every rank moves on to an older one (unless one was asked for).
        """
        sources = self._file_sources(rt, None)
        manifest = None
        for tier in sources:
            try:
                manifest = self._sealed_manifest(tier, step)
                break
            except (IntegrityError, StorageError, CheckpointNotFoundError):
                continue
        if manifest is None:
            return f"rank {self.rank}: no tier holds a sealed manifest of step {step}"
        world = self._world_size()
        for name in sorted(manifest.files):
            if _file_rank(name) % world != self.rank:
                continue
            errors = []
            for tier in self._file_sources(rt, name):
                try:
                    self._verify_file(tier, manifest, name, frozenset(manifest.files))
                    break
                except (IntegrityError, StorageError, CheckpointNotFoundError) as exc:
                    errors.append(f"{tier.name}: {exc}")
                    self._bad.add((tier.name, step, name))
            else:
                return f"rank {self.rank}: no good copy of {name} ({'; '.join(errors) or 'no tier holds it'})"
        return None

    def _durable_candidates(self, durable: Tier) -> frozenset[int]:
        """Committed durable steps, dropping newest ones whose seal or metadata is damaged."""
        steps = sorted(
            (s.step for s in durable.list_steps()
             if s.step not in self.exclude and (self.requested is None or s.step == self.requested)),
            reverse=True,
        )
        for i, step in enumerate(steps):
            try:
                self._check_metadata(durable, self._sealed_manifest(durable, step))
                return frozenset(steps[i:])
            except (IntegrityError, CheckpointNotFoundError) as exc:
                self._log.warning(step, "durable copy rejected: %s", exc)
        return frozenset()

    def _fetch(self, tier: Tier, step: int, name: str, size: int) -> memoryview:
        """A data file, fetched (mapped or downloaded) once per load."""
        key = (tier.name, step, name)
        if key not in self._views:
            self._views[key] = fetch_file(tier, step, name, size)
        return self._views[key]

    def _check_metadata(self, tier: Tier, manifest: layout.Manifest) -> bytes:
        """The verified ``.metadata`` bytes, read once per (tier, step) during this load."""
        key = (tier.name, manifest.step)
        if key not in self._metadata_raw:
            self._metadata_raw[key] = verified_metadata(tier, manifest)
        return self._metadata_raw[key]

    def _world_size(self) -> int:
        if self.single_process or not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    def _sealed_manifest(self, tier: Tier, step: int) -> layout.Manifest:
        """The step's sealed manifest, read once per (tier, step) during this load."""
        key = (tier.name, step)
        if key not in self._manifests:
            self._manifests[key] = sealed_manifest(tier, step, self.config.namespace)
        return self._manifests[key]

    def _verify_file(self, tier: Tier, manifest: layout.Manifest, name: str, present: frozenset[str]) -> None:
        records = [r for r in manifest.items if r.file == name]
        if name in present and records:
            view = self._fetch(tier, manifest.step, name, manifest.files[name])
            verify_items(view, records, f"{tier.location(manifest.step)}/{name}", self.runtime.executor.map)
            self._verified.add((tier.name, manifest.step, name, manifest.save_id))

    def _read_verified_metadata(self, rt: RankRuntime, step: int) -> Metadata:
        errors = []
        for tier in self._file_sources(rt, None):
            try:
                manifest = self._sealed_manifest(tier, step)
                md_raw = self._check_metadata(tier, manifest)
                metadata = loads_metadata(md_raw, where=f"{tier.location(step)}/.metadata")
                self._manifest = manifest
                self._records = manifest.item_index()
                return metadata
            except (IntegrityError, StorageError, CheckpointNotFoundError) as exc:
                self._log.warning(step, "metadata from the %s tier rejected: %s", tier.name, exc)
                errors.append(f"{tier.name}: {exc}")
        raise IntegrityError(f"step {step}: no readable metadata ({'; '.join(errors) or 'no tier holds it'})", step=step)


    # -- planning -------------------------------------------------------------------
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._storage_data = dict(metadata.storage_data or {})
        self._chunks = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for i, chunk in enumerate(md.chunks):
                    self._chunks[MetadataIndex(fqn, chunk.offsets, i)] = (md.properties.dtype, tuple(chunk.sizes))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    # -- reading --------------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        import time

        rt, step = self.runtime, self.step
        assert step is not None and self._manifest is not None
        t0, nbytes = time.perf_counter(), 0
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self._storage_data[req.storage_index].relative_path, []).append(req)
        try:
            for name, reqs in sorted(per_file.items()):
                nbytes += self._read_file_items(rt, step, name, reqs, planner)
        except TierckptError as exc:
            self.failure = exc
            raise
        finally:
            self._views.clear()  # unmap: the tensors hold copies
        self._log.info(step, "Read %d items from %s in %s", len(plan.items), sorted(set(self.tiers_used.values())), throughput(nbytes, time.perf_counter() - t0))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_file_items(self, rt: RankRuntime, step: int, name: str, reqs: list[ReadItem], planner: LoadPlanner) -> int:
        assert self._manifest is not None
        errors = []
        for tier in self._file_sources(rt, name):
            if (tier.name, step, name) in self._bad:
                continue
            try:
                view = self._fetch(tier, step, name, self._manifest.files.get(name, -1))
                records = [self._record_for(name, req) for req in reqs]
                if (tier.name, step, name, self._manifest.save_id) not in self._verified:
                    verify_items(view, records, f"{tier.location(step)}/{name}", rt.executor.map)
                for req, r in zip(reqs, records, strict=True):
                    self._apply(req, r, view[r.offset : r.offset + r.length], planner)
                self.tiers_used[name] = tier.name
                return sum(r.length for r in records)
            except (IntegrityError, StorageError, CheckpointNotFoundError) as exc:
                self._log.warning(step, "%s from the %s tier unusable, trying the next copy: %s", name, tier.name, exc)
                errors.append(f"{tier.name}: {exc}")
        raise IntegrityError(f"step {step}: no good copy of {name} ({'; '.join(errors) or 'no tier holds it'})", step=step, path=name)

    def _file_sources(self, rt: RankRuntime, name: str | None) -> list[Tier]:
        """Tiers to try for a data file (or, with None, for the step's metadata), fastest first."""
        out: list[Tier] = []
        if (name in self._in_memory) if name is not None else bool(self._in_memory):
            out.append(rt.memory)
        if self._peer is not None and ((name in self._in_peer) if name is not None else bool(self._in_peer)):
            out.append(self._peer)
        if rt.durable is not None:
            out.append(rt.durable)
        return out

    def _record_for(self, name: str, req: ReadItem) -> layout.ItemRecord:
        info = self._storage_data[req.storage_index]
        rec = self._records.get((name, info.offset))
        if rec is None or rec.length != info.length:
            raise IntegrityError(f"{name}: item {req.storage_index.fqn} is not in the manifest")
        return rec

    def _apply(self, req: ReadItem, rec: layout.ItemRecord, raw: memoryview, planner: LoadPlanner) -> None:
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(bytes(raw)))
            return
        if rec.data_offset >= 0:
            dtype, sizes = self._chunks[req.storage_index]
            nbytes = _numel(sizes) * dtype.itemsize
            if rec.data_offset + nbytes > len(raw):
                raise IntegrityError(f"item {req.storage_index.fqn}: record shorter than its tensor")
            if nbytes:
                with warnings.catch_warnings():  # a read-only mapping: the view is only read from
                    warnings.filterwarnings("ignore", message="The given buffer is not writable")
                    src = torch.frombuffer(raw, dtype=torch.uint8, count=nbytes, offset=rec.data_offset)
            else:
                src = torch.empty(0, dtype=torch.uint8)
            tensor = src.view(dtype).view(sizes)
        else:
            tensor = torch.load(io.BytesIO(bytes(raw)), map_location="cpu", weights_only=True)
        for dim, (off, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
            if off != 0 or length != tensor.size(dim):
                tensor = tensor.narrow(dim, off, length)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise StateDictMismatchError(
                f"{req.dest_index.fqn}: checkpoint holds {tuple(tensor.size())}, state dict expects {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)


def _demote(a: Availability, step: int, reason: str) -> Availability:
    """``a`` with ``step`` marked unloadable in every tier, for the next round of choosing."""
    return dataclasses.replace(
        a,
        memory={s: f for s, f in a.memory.items() if s != step},
        durable=None if a.durable is None else a.durable - {step},
        bad={**a.bad, step: reason},
    )


def _file_rank(name: str) -> int:
    """``'__3_0.distcp'`` → 3 (files not named by rank count as rank 0's)."""
    head = name[2:].split("_", 1)[0] if name.startswith("__") else ""
    return int(head) if head.isdigit() else 0


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _check_state_dict(state_dict: dict[str, Any], metadata: Metadata, step: int) -> None:
    """Raise StateDictMismatchError when keys, shapes or kinds differ from the checkpoint."""
    flat, _ = flatten_state_dict(resolve_stateful(state_dict))
    saved = metadata.state_dict_metadata
    missing = sorted(k for k in flat if k not in saved)
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    for key, value in flat.items():
        md = saved.get(key)
        if md is None:
            continue
        if isinstance(value, torch.Tensor):
            shape = tuple(value.size()) if not isinstance(value, DTensor) else tuple(value.shape)
            if not isinstance(md, TensorStorageMetadata):
                problems.append(f"{key}: the checkpoint holds an object, the state dict a tensor")
            elif tuple(md.size) != shape:
                problems.append(f"{key}: checkpoint shape {tuple(md.size)}, state dict shape {shape}")
        elif isinstance(md, TensorStorageMetadata) and not isinstance(md, BytesStorageMetadata):
            problems.append(f"{key}: the checkpoint holds a tensor, the state dict a {type(value).__name__}")
    if problems:
        raise StateDictMismatchError(
            f"the state dict does not match step {step}: " + "; ".join(problems[:8]), step=step
        )
