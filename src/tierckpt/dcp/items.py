"""Reading a load plan's items: each saved record read once, checked as it lands, straight into its tensor.

Call order (``TieredStorageReader.read_data``, every rank): ``ItemReader(...)`` → ``read(plan,
planner)``: per data file, the records the plan needs (never the whole file: resharding reads
only the records that overlap this rank's shards), from the fastest tier first:

  direct    a record whose tensor lands whole in a contiguous CPU target of the same dtype is
            read into the target's own memory, hashed piece by piece as it lands (memory tier:
            ``pread``, 1 MiB at a time, no mapping); nothing else is allocated
  buffered  anything else (a narrowed shard, a cast, a GPU target, a byte item) is read into a
            buffer of the record's size, checked, copied, and freed; at most one per thread

Records are read in parallel (the tier's threads; ``os.preadv`` and xxh3 release the GIL). A
record failing its checksum makes that copy of the file unusable: every record of the file is
read again from the next tier (so a target first written from a bad copy is overwritten); no
good copy left → IntegrityError. Byte items pass ``safeload.check_object`` before the planner
unpickles them; the planner's ``commit_tensor`` / ``load_bytes`` run on the calling thread.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from tierckpt import layout
from tierckpt.dcp.safeload import check_object
from tierckpt.dcp.sources import TIER_ERRORS, StepSources
from tierckpt.errors import IntegrityError, StateDictMismatchError
from tierckpt.observability import StepLogger
from tierckpt.tiers import Tier
from tierckpt.tiers.base import RangeReader
from tierckpt.tiers.integrity import MappedReader, open_reader, read_record

__all__ = ["ItemReader"]


@dataclass
class _Job:
    """One saved record and the requests it serves (target None for a byte item)."""

    rec: layout.ItemRecord
    reqs: list[tuple[ReadItem, torch.Tensor | None]] = field(default_factory=list)
    direct: memoryview | None = None  # the target's own bytes, when the record's data goes straight in


class ItemReader:
    """Reads one step's items for one rank; ``tiers_used`` tells which tier each file came from."""

    def __init__(
        self, sources: StepSources, step: int, manifest: layout.Manifest, metadata: Any, *,
        executor: ThreadPoolExecutor, threads: int, log: StepLogger, trusted: bool, allowed: Iterable[Any],
    ) -> None:
        self.sources, self.step, self.manifest = sources, step, manifest
        self.executor, self.threads, self.log = executor, threads, log
        self.trusted, self.allowed = trusted, tuple(allowed)
        self.storage_data: dict[MetadataIndex, Any] = dict(metadata.storage_data or {})
        self.chunks = _chunk_shapes(metadata)
        self.records = manifest.item_index()
        self.tiers_used: dict[str, str] = {}

    def read(self, plan: LoadPlan, planner: LoadPlanner) -> int:
        """Read every item of ``plan``; return the bytes read."""
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        # files with byte items first, and in each file its byte items first: small objects (a
        # data loader's position: tierckpt.data) reach the planner before the tensors load
        order = sorted(per_file.items(), key=lambda kv: (not _has_bytes(kv[1]), kv[0]))
        return sum(self._read_file(name, reqs, planner) for name, reqs in order)

    def _read_file(self, name: str, reqs: list[ReadItem], planner: LoadPlanner) -> int:
        jobs = self._jobs(name, reqs, planner)
        errors = []
        for tier in self.sources.tiers_for(name):
            if (tier.name, self.step, name) in self.sources.bad:
                continue
            try:
                self._run(tier, name, jobs, planner)
            except TIER_ERRORS as exc:
                self.log.warning(self.step, "%s from the %s tier unusable, trying the next copy: %s", name, tier.name, exc)
                errors.append(f"{tier.name}: {exc}")
                self.sources.bad.add((tier.name, self.step, name))
                continue
            self.tiers_used[name] = tier.name
            return sum(j.rec.length for j in jobs)
        raise IntegrityError(
            f"step {self.step}: no good copy of {name} ({'; '.join(errors) or 'no tier holds it'})",
            step=self.step, path=name,
        )

    def _jobs(self, name: str, reqs: list[ReadItem], planner: LoadPlanner) -> list[_Job]:
        jobs: dict[int, _Job] = {}
        for req in reqs:
            rec = self._record_for(name, req)
            target = None if req.type == LoadItemType.BYTE_IO else planner.resolve_tensor(req).detach()
            jobs.setdefault(rec.offset, _Job(rec)).reqs.append((req, target))
        for job in jobs.values():
            job.direct = self._direct_bytes(job)
        return sorted(jobs.values(), key=lambda j: (not _has_bytes(r for r, _ in j.reqs), j.rec.offset))

    def _direct_bytes(self, job: _Job) -> memoryview | None:
        """The target's bytes when the record's tensor can be read straight into it, else None."""
        if len(job.reqs) != 1 or job.rec.data_offset < 0:
            return None
        req, target = job.reqs[0]
        if target is None:
            return None
        dtype, sizes = self.chunks[req.storage_index]
        whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == sizes
        if not (whole and target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
                and tuple(target.size()) == sizes and target.numel() > 0 and not target.is_conj() and not target.is_neg()):
            return None
        try:
            raw: Any = target.reshape(-1).view(torch.uint8).numpy()  # shares the target's memory
        except (RuntimeError, TypeError):  # no numpy, or a tensor numpy cannot view: use a buffer
            return None
        return memoryview(raw).cast("B")

    def _run(self, tier: Tier, name: str, jobs: list[_Job], planner: LoadPlanner) -> None:
        """Read ``jobs`` from one tier in parallel; finish each on this thread, in order."""
        where = f"{tier.location(self.step)}/{name}"
        reader = self._mapped(tier, name, where) or open_reader(tier, self.step, name)
        own_pool = None
        try:
            pool = self.executor
            if reader.concurrency > self.threads and len(jobs) > 1:
                pool = own_pool = ThreadPoolExecutor(min(len(jobs), reader.concurrency), thread_name_prefix="tierckpt-read")
            futures = [pool.submit(self._work, reader, job, where) for job in jobs]
            try:
                for job, fut in zip(jobs, futures, strict=True):
                    self._finish(job, fut.result(), planner)
            except BaseException:
                for f in futures:  # no read of this copy may still write into a target
                    f.cancel()
                wait(futures)
                raise
        finally:
            if own_pool is not None:
                own_pool.shutdown(wait=True)
            reader.close()

    def _mapped(self, tier: Tier, name: str, where: str) -> RangeReader | None:
        """A reader over this process's own mapping of the file's slot (a load after a save)."""
        rt = self.sources.rt
        if tier is not rt.memory:
            return None
        slot = rt.pool.mapped(rt.memory.step_dir(self.step) / name)
        if slot is None:
            return None
        try:
            return MappedReader(slot.numpy(), where)
        except (RuntimeError, TypeError, ImportError):  # no numpy: read the file instead
            return None

    def _work(self, reader: RangeReader, job: _Job, where: str) -> list[bytes]:
        """Read and check one record; copy its tensors; return the bytes of its byte items."""
        if job.direct is not None:
            read_record(reader, job.rec, where, data=job.direct)
            return []
        buf = read_record(reader, job.rec, where)
        if buf is None:  # read_record returns the record's buffer whenever no destination is given
            raise IntegrityError(f"{where}: item at offset {job.rec.offset} could not be buffered")
        out = []
        for req, target in job.reqs:
            if target is None:
                out.append(bytes(buf))
            else:
                self._copy(req, job.rec, buf, target)
        return out

    def _finish(self, job: _Job, raws: list[bytes], planner: LoadPlanner) -> None:
        objects = iter(raws)
        for req, target in job.reqs:
            if target is None:
                raw = next(objects)
                check_object(raw, key=req.dest_index.fqn, step=self.step, trusted=self.trusted, allowed=self.allowed)
                planner.load_bytes(req, io.BytesIO(raw))
            else:
                planner.commit_tensor(req, target)

    def _record_for(self, name: str, req: ReadItem) -> layout.ItemRecord:
        info = self.storage_data[req.storage_index]
        rec = self.records.get((name, info.offset))
        if rec is None or rec.length != info.length:
            raise IntegrityError(f"{name}: item {req.storage_index.fqn} is not in the manifest", step=self.step)
        return rec

    def _copy(self, req: ReadItem, rec: layout.ItemRecord, raw: memoryview, target: torch.Tensor) -> None:
        """Copy one request's part of a checked record into its target (narrowed, cast as DCP does)."""
        if rec.data_offset >= 0:
            dtype, sizes = self.chunks[req.storage_index]
            nbytes = math.prod(sizes) * dtype.itemsize
            if rec.data_offset + nbytes > len(raw):
                raise IntegrityError(f"item {req.storage_index.fqn}: record shorter than its tensor", step=self.step)
            if nbytes:
                with warnings.catch_warnings():  # a checked scratch buffer: only read from
                    warnings.filterwarnings("ignore", message="The given buffer is not writable")
                    src = torch.frombuffer(raw, dtype=torch.uint8, count=nbytes, offset=rec.data_offset)
            else:
                src = torch.empty(0, dtype=torch.uint8)
            tensor = src.view(dtype).view(sizes)
        else:  # a record tierckpt did not write (plain DCP): a torch.save'd tensor
            tensor = torch.load(io.BytesIO(bytes(raw)), map_location="cpu", weights_only=True)
        for dim, (off, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
            if off != 0 or length != tensor.size(dim):
                tensor = tensor.narrow(dim, off, length)
        if target.size() != tensor.size():
            raise StateDictMismatchError(
                f"{req.dest_index.fqn}: checkpoint holds {tuple(tensor.size())}, state dict expects {tuple(target.size())}",
                step=self.step,
            )
        target.copy_(tensor)


def _has_bytes(reqs: Iterable[ReadItem]) -> bool:
    return any(r.type == LoadItemType.BYTE_IO for r in reqs)


def _chunk_shapes(metadata: Any) -> dict[MetadataIndex, tuple[torch.dtype, tuple[int, ...]]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for i, chunk in enumerate(md.chunks):
                out[MetadataIndex(fqn, chunk.offsets, i)] = (md.properties.dtype, tuple(chunk.sizes))
    return out
