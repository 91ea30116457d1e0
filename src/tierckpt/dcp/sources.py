"""Where one load's step can come from: the tiers this rank reaches, checked before anyone reads.

Call order (every rank, inside ``TieredStorageReader.read_metadata``):
  ``StepSources(...)`` → ``local_availability()`` (memory steps whose seal and metadata check
  out; peers through the node agent; rank 0 also lists the durable tier) → [gather, choose the
  step: ``agree.py``] → ``use(step, local)`` → ``precheck(step, world)`` (every rank, then gathered:
  a sealed manifest, and with ``verify_data`` this rank's share of the files checked item by
  item) → ``metadata(step)`` (the verified DCP Metadata and the manifest) → later, per data file,
  ``tiers_for(name)`` (fastest first, copies found bad skipped).
Manifests and metadata are read once per (tier, step) during a load.
"""

from __future__ import annotations

from typing import Any

from tierckpt import layout
from tierckpt.config import CheckpointConfig
from tierckpt.dcp.agree import Availability
from tierckpt.errors import CheckpointNotFoundError, IntegrityError, StorageError
from tierckpt.observability import StepLogger
from tierckpt.record import loads_metadata
from tierckpt.runtime import RankRuntime
from tierckpt.tiers import Tier
from tierckpt.tiers.integrity import hash_record, new_buffer, open_reader, sealed_manifest, verified_metadata
from tierckpt.tiers.peer import open_peer

__all__ = ["TIER_ERRORS", "StepSources", "file_rank"]

#: what makes one copy unusable (and the next copy worth trying)
TIER_ERRORS = (IntegrityError, StorageError, CheckpointNotFoundError)


class StepSources:
    """The tiers of one load, their sealed manifests and metadata, and the copies found bad."""

    def __init__(
        self, config: CheckpointConfig, rt: RankRuntime, rank: int, log: StepLogger, *,
        requested: int | None, exclude: frozenset[int],
    ) -> None:
        self.config, self.rt, self.rank, self.log = config, rt, rank, log
        self.requested, self.exclude = requested, exclude
        self.in_memory: frozenset[str] = frozenset()
        self.in_peer: frozenset[str] = frozenset()
        self.peer: Tier | None = None
        self.bad: set[tuple[str, int, str]] = set()  # (tier, step, file) copies found damaged
        self._manifests: dict[tuple[str, int], layout.Manifest] = {}
        self._metadata_raw: dict[tuple[str, int], bytes] = {}

    # -- what this rank can load ------------------------------------------------------
    def local_availability(self) -> Availability:
        """Memory steps whose seal and metadata check out (files present at their sizes); peers;
        on rank 0 the durable steps, the newest of them with its seal and metadata checked."""
        memory: dict[int, frozenset[str]] = {}
        files: dict[int, frozenset[str]] = {}
        bad: dict[int, str] = {}
        listings = [s for s in self.rt.memory.list_steps() if self._wanted(s.step)]
        for listing in sorted(listings, key=lambda s: s.step, reverse=True):
            try:
                manifest = self.manifest(self.rt.memory, listing.step)
                present = frozenset(n for n, size in manifest.files.items() if listing.files.get(n) == size)
                self._check_metadata(self.rt.memory, manifest)
            except TIER_ERRORS as exc:
                bad[listing.step] = f"memory copy rejected ({exc})"
                continue
            memory[listing.step] = present
            files[listing.step] = frozenset(manifest.files)
        peer = self._peer_availability(files)
        durable, durable_error = None, None
        if self.rank == 0 and self.rt.durable is not None:
            try:
                durable = self._durable_candidates(self.rt.durable)
            except StorageError as exc:
                self.log.warning(None, "durable tier unavailable, using memory only: %s", exc)
                durable, durable_error = frozenset(), str(exc)
        before = self.config.resume_before if self.requested is None else None
        return Availability(self.rank, memory, files, durable, bad, durable_error, peer, before)

    def _wanted(self, step: int) -> bool:
        return step not in self.exclude and (self.requested is None or step == self.requested)

    def _peer_availability(self, files: dict[int, frozenset[str]]) -> dict[int, frozenset[str]]:
        """Files of each step that this node's agent can fetch from peers (none without an agent)."""
        peer = open_peer(self.rt.config.memory_dir, self.rt.config.namespace)
        self.peer = peer
        if peer is None:
            return {}
        try:
            catalog = peer.catalog()
        except (StorageError, ValueError, KeyError, TypeError) as exc:
            self.log.warning(None, "the node agent cannot list peers, loading without them: %s", exc)
            self.peer = None
            return {}
        out: dict[int, frozenset[str]] = {}
        for step, entry in catalog.items():
            if not self._wanted(step):
                continue
            out[step] = frozenset(entry.held)
            if step not in files and entry.all_files:
                files[step] = entry.all_files
        return out

    def _durable_candidates(self, durable: Tier) -> frozenset[int]:
        """Committed durable steps, dropping newest ones whose seal or metadata is damaged."""
        steps = sorted((s.step for s in durable.list_steps() if self._wanted(s.step)), reverse=True)
        for i, step in enumerate(steps):
            try:
                self._check_metadata(durable, self.manifest(durable, step))
                return frozenset(steps[i:])
            except (IntegrityError, CheckpointNotFoundError) as exc:
                self.log.warning(step, "durable copy rejected: %s", exc)
        return frozenset()

    # -- the chosen step ----------------------------------------------------------------
    def use(self, step: int, local: Availability) -> None:
        """Read ``step``: this rank's memory and peer files of it come first."""
        self.in_memory = local.memory.get(step, frozenset())
        self.in_peer = local.peer.get(step, frozenset())

    def precheck(self, step: int, world: int, *, verify_data: bool) -> str | None:
        """Check this rank's part of the step before anyone reads: None if all good, else why not.

        Always: some tier holds a sealed manifest. With ``verify_data``, also this rank's share
        of the files (every ``__k_*`` with ``k % world == rank``, so the ranks together check
        every file whatever the world size was at save time), item by item through a scratch
        buffer, in the tier this rank would read it from, falling back to the next tier. A file
        with no good copy makes the step unloadable, and every rank moves on to an older one.
        Without it, items are checked only while they are read (one pass, no step fallback
        inside ``dcp.load``: ``Checkpointer.load`` retries an older step itself).
        """
        manifest = None
        for tier in self.tiers_for(None):
            try:
                manifest = self.manifest(tier, step)
                break
            except TIER_ERRORS:
                continue
        if manifest is None:
            return f"rank {self.rank}: no tier holds a sealed manifest of step {step}"
        if not verify_data:
            return None
        scratch = new_buffer(8 << 20)
        for name in sorted(manifest.files):
            if file_rank(name) % world != self.rank:
                continue
            errors = []
            for tier in self.tiers_for(name):
                try:
                    self._check_file(tier, manifest, name, scratch)
                    break
                except TIER_ERRORS as exc:
                    errors.append(f"{tier.name}: {exc}")
                    self.bad.add((tier.name, step, name))
            else:
                return f"rank {self.rank}: no good copy of {name} ({'; '.join(errors) or 'no tier holds it'})"
        return None

    def _check_file(self, tier: Tier, manifest: layout.Manifest, name: str, scratch: memoryview) -> None:
        records = [r for r in manifest.items if r.file == name]
        if not records:
            return
        reader = open_reader(tier, manifest.step, name)
        try:
            for rec in records:
                hash_record(reader, rec, f"{tier.location(manifest.step)}/{name}", scratch)
        finally:
            reader.close()

    def metadata(self, step: int) -> tuple[Any, layout.Manifest]:
        """The step's verified DCP Metadata and sealed manifest, from the fastest tier holding both."""
        errors = []
        for tier in self.tiers_for(None):
            try:
                manifest = self.manifest(tier, step)
                raw = self._check_metadata(tier, manifest)
                return loads_metadata(raw, where=f"{tier.location(step)}/.metadata"), manifest
            except TIER_ERRORS as exc:
                self.log.warning(step, "metadata from the %s tier rejected: %s", tier.name, exc)
                errors.append(f"{tier.name}: {exc}")
        raise IntegrityError(f"step {step}: no readable metadata ({'; '.join(errors) or 'no tier holds it'})", step=step)

    def tiers_for(self, name: str | None) -> list[Tier]:
        """Tiers to try for a data file (or, with None, for the step's metadata), fastest first."""
        out: list[Tier] = []
        if (name in self.in_memory) if name is not None else bool(self.in_memory):
            out.append(self.rt.memory)
        if self.peer is not None and ((name in self.in_peer) if name is not None else bool(self.in_peer)):
            out.append(self.peer)
        if self.rt.durable is not None:
            out.append(self.rt.durable)
        return out

    def manifest(self, tier: Tier, step: int) -> layout.Manifest:
        """The step's sealed manifest, read once per (tier, step) during this load."""
        key = (tier.name, step)
        if key not in self._manifests:
            self._manifests[key] = sealed_manifest(tier, step, self.config.namespace)
        return self._manifests[key]

    def _check_metadata(self, tier: Tier, manifest: layout.Manifest) -> bytes:
        """The verified ``.metadata`` bytes, read once per (tier, step) during this load."""
        key = (tier.name, manifest.step)
        if key not in self._metadata_raw:
            self._metadata_raw[key] = verified_metadata(tier, manifest)
        return self._metadata_raw[key]


def file_rank(name: str) -> int:
    """``'__3_0.distcp'`` → 3 (files not named by rank count as rank 0's)."""
    head = name[2:].split("_", 1)[0] if name.startswith("__") else ""
    return int(head) if head.isdigit() else 0
