"""Reading checkpoints that ``amzn-sagemaker-checkpointing`` (1.1.x) wrote to S3.

Its format, per step (paths from the configured ``S3PathStrategy``):

    rank_{R} file ``checkpoint.pt``   every item of rank R's write plan, back to back: a tensor
                                      item is ``torch.save(tensor)`` (a whole zip archive each),
                                      a bytes item its raw bytes
    rank_0 file ``metadata.metadata`` ``pickle.dumps(Metadata)`` by the coordinator, whose
                                      ``storage_data`` maps each ``MetadataIndex`` to
                                      ``_SageMakerStorageInfo(rank, offset, length)``

There is no commit marker: a step is complete when its metadata exists and every rank the
metadata refers to has its ``checkpoint.pt``. There are no checksums either; tensors are read
with ``torch.load(weights_only=True)`` and the metadata with tierckpt's restricted unpickler
(DCP's metadata classes and the storage-info record only), so a doctored object cannot run code.

Call order: ``LegacySource(...)`` → ``newest(requested)`` → ``read_items(step, metadata, items,
planner)`` for each rank's share of a load plan.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tierckpt.compat.sagemaker_paths import RayS3PathStrategy, S3PathStrategy
from tierckpt.config import DurableLocation, S3Settings
from tierckpt.errors import CheckpointNotFoundError, IntegrityError, StateDictMismatchError, StorageError
from tierckpt.record import _MetadataUnpickler

__all__ = [
    "CHECKPOINT_FILE", "METADATA_FILE", "LegacySource", "LegacyStepReader", "SafeLoadPlanner", "SageMakerStorageInfo",
]

CHECKPOINT_FILE = "checkpoint.pt"
METADATA_FILE = "metadata.metadata"
_STORAGE_INFO = ("amzn_sagemaker_checkpointing.checkpointing.filesystem.storage_info", "_SageMakerStorageInfo")


@dataclass
class SageMakerStorageInfo:
    """The library's ``_SageMakerStorageInfo``: where an item lies in rank ``rank``'s blob."""

    rank: int
    offset: int
    length: int


class _LegacyUnpickler(_MetadataUnpickler):
    """tierckpt's metadata allow-list plus the library's storage-info record (as ours)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _STORAGE_INFO:
            return SageMakerStorageInfo
        return super().find_class(module, name)


def loads_legacy_metadata(raw: bytes, where: str) -> Metadata:
    try:
        metadata = _LegacyUnpickler(io.BytesIO(raw)).load()
    except IntegrityError:
        raise
    except Exception as exc:  # any unpickling failure means the object is unusable
        raise IntegrityError(f"{where} cannot be read: {exc}") from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise IntegrityError(f"{where} is not a DCP Metadata with storage data")
    if not all(isinstance(v, SageMakerStorageInfo) for v in metadata.storage_data.values()):
        raise IntegrityError(f"{where} was not written by amzn-sagemaker-checkpointing (unknown storage data)")
    return metadata


class LegacySource:
    """The SageMaker library's checkpoints of ``namespace`` under ``strategy.base_path`` on S3."""

    def __init__(self, strategy: S3PathStrategy, namespace: str, s3: S3Settings | None = None,
                 logger: logging.Logger | None = None) -> None:
        from tierckpt.tiers.s3 import make_client

        location = DurableLocation.parse(str(strategy.base_path).rstrip("/"))
        if location.scheme != "s3" or location.bucket is None:
            raise StorageError(f"{strategy.base_path!r} is not an s3:// path", tier="durable")
        self.strategy, self.namespace = strategy, namespace
        self.bucket, self.prefix = location.bucket, location.prefix
        self.client = make_client(s3 or S3Settings())
        self.log = logger or logging.getLogger("tierckpt.compat")

    def _key(self, rank: int, step: int, filename: str) -> str:
        uri = self.strategy.get_s3_uri(self.namespace, rank, step, filename)
        return uri[len(f"s3://{self.bucket}/") :]

    def step_ranks(self) -> dict[int, set[int]]:
        """{step: ranks that hold a prefix for it}, listed in the strategy's layout."""
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            if isinstance(self.strategy, RayS3PathStrategy):
                return self.strategy.find_step_ranks(paginator, self.bucket, self.prefix, self.namespace, 0)
            ns = f"{self.prefix}/{self.namespace}/" if self.prefix else f"{self.namespace}/"
            children = self.strategy._children(paginator, self.bucket, ns)
            ranks = [r for r in (self.strategy._parse(p, "rank") for p in children) if r is not None]
            world = max(ranks) + 1 if ranks else 0  # the default layout lists per rank: how many to try
            return self.strategy.find_step_ranks(paginator, self.bucket, self.prefix, self.namespace, world)
        except Exception as exc:  # botocore raises many types; all mean the listing failed
            raise StorageError(f"listing {self.strategy.base_path}/{self.namespace} failed: {exc}", tier="durable") from exc

    def _get(self, key: str) -> bytes | None:
        try:
            return bytes(self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read())
        except self.client.exceptions.NoSuchKey:
            return None
        except Exception as exc:
            raise StorageError(f"reading s3://{self.bucket}/{key} failed: {exc}", tier="durable") from exc

    def metadata(self, step: int) -> Metadata | None:
        raw = self._get(self._key(0, step, METADATA_FILE))
        return None if raw is None else loads_legacy_metadata(raw, self.strategy.get_s3_uri(self.namespace, 0, step, METADATA_FILE))

    def newest(self, requested: int | None = None) -> tuple[int, Metadata] | None:
        """The newest complete step (or ``requested`` if complete) and its metadata; None if none."""
        found = self.step_ranks()
        for step in sorted(found, reverse=True):
            if requested is not None and step != requested:
                continue
            try:
                metadata = self.metadata(step)
            except IntegrityError as exc:
                self.log.warning("SageMaker step %d skipped: %s", step, exc)
                continue
            if metadata is None:
                continue
            needed = {info.rank for info in metadata.storage_data.values()}
            if needed <= found[step]:
                return step, metadata
            self.log.warning("SageMaker step %d skipped: no %s for rank(s) %s", step, CHECKPOINT_FILE,
                             sorted(needed - found[step]))
        return None

    def blob(self, step: int, rank: int) -> bytes:
        raw = self._get(self._key(rank, step, CHECKPOINT_FILE))
        if raw is None:
            raise CheckpointNotFoundError(
                f"{self.strategy.get_s3_uri(self.namespace, rank, step, CHECKPOINT_FILE)} is gone", step=step, tier="durable"
            )
        return raw

    def read_items(self, step: int, metadata: Metadata, items: list[ReadItem], planner: LoadPlanner) -> int:
        """Load ``items`` into the planner's state dict; returns the bytes fetched."""
        per_rank: dict[int, list[ReadItem]] = {}
        for item in items:
            per_rank.setdefault(metadata.storage_data[item.storage_index].rank, []).append(item)
        fetched = 0
        for rank, rank_items in sorted(per_rank.items()):
            data = self.blob(step, rank)
            fetched += len(data)
            for item in rank_items:
                _apply(item, metadata.storage_data[item.storage_index], data, planner, step)
        return fetched


def _apply(item: ReadItem, info: SageMakerStorageInfo, blob: bytes, planner: LoadPlanner, step: int) -> None:
    if info.offset < 0 or info.offset + info.length > len(blob):
        raise IntegrityError(f"step {step}: item {item.storage_index.fqn} lies outside rank {info.rank}'s blob", step=step)
    stream = io.BytesIO(blob[info.offset : info.offset + info.length])
    if item.type == LoadItemType.BYTE_IO:
        # DCP's planner unpickles in full: first prove the object is plain data (weights-only)
        try:
            torch.load(io.BytesIO(stream.getbuffer()), weights_only=True)
        except Exception as exc:
            raise IntegrityError(
                f"step {step}: {item.storage_index.fqn!r} holds an object a weights-only load refuses ({exc}); "
                "tierckpt loads only plain data (numbers, strings, containers, tensors) from SageMaker "
                "checkpoints; convert trusted ones with 'tierckpt import --trust-objects'", step=step,
            ) from exc
        planner.load_bytes(item, stream)
        return
    try:
        tensor = torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise IntegrityError(f"step {step}: item {item.storage_index.fqn} is not a saved tensor: {exc}", step=step) from exc
    for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        tensor = tensor.narrow(dim, offset, length)
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise StateDictMismatchError(
            f"step {step}: {item.storage_index.fqn} is {tuple(tensor.size())} in the checkpoint, "
            f"{tuple(target.size())} in the state dict", step=step,
        )
    target.copy_(tensor)
    planner.commit_tensor(item, target)


class LegacyStepReader(StorageReader):
    """A DCP StorageReader over one source step whose metadata is already read (one process)."""

    def __init__(self, source: LegacySource, step: int, metadata: Metadata) -> None:
        super().__init__()
        self.source, self.step, self.metadata = source, step, metadata

    def reset(self, checkpoint_id: Any = None) -> None:
        """Nothing to reset: the step is fixed."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """The metadata is already held."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.source.read_items(self.step, self.metadata, list(plan.items), planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, non-tensor values restored by ``torch.load(weights_only=True)``."""

    def __init__(self, *, trust_objects: bool = False) -> None:
        super().__init__()
        self.trust_objects = trust_objects

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=not self.trust_objects)
        except Exception as exc:
            raise IntegrityError(
                f"{fqn!r} holds an object that a weights-only load refuses ({exc}); convert with "
                "--trust-objects only if the checkpoint comes from a trusted source"
            ) from exc
        if not self.flatten_state_dict:
            self.state_dict[fqn] = obj
            return
        # as DCP's planner: the value goes into the caller's (nested) state dict at its key path
        *parents, last = self.mappings[fqn]
        node: Any = self.original_state_dict
        for key in parents:
            node = node[key]
        node[last] = obj
