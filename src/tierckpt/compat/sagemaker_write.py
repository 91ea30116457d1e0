"""Writing the SageMaker library's own S3 format, so that ``amzn-sagemaker-checkpointing`` reads it.

The format is the one ``tierckpt.compat.legacy`` reads (its docstring has the details): per
rank one ``checkpoint.pt`` holding every item of the rank's write plan back to back (a tensor as
``torch.save(tensor.detach().contiguous().cpu())``, a bytes item raw), and beside rank 0's the
coordinator's ``metadata.metadata``, ``pickle.dumps(Metadata)`` whose ``storage_data`` maps
each item to the library's ``_SageMakerStorageInfo(rank, offset, length)``, pickled under the
library's class name so that the library unpickles it without tierckpt installed.

Call order (one save, driven by the compat writer): ``encode_items`` on every rank in
``write_data`` → ``SageMakerS3Sink.put`` of that rank's ``checkpoint.pt`` → on the coordinator,
in ``finish``, ``dumps_metadata`` → ``SageMakerS3Sink.put`` of ``metadata.metadata``, last:
the library (and tierckpt) take a step as complete only once its metadata exists.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from tierckpt.compat.legacy import SageMakerStorageInfo
from tierckpt.compat.sagemaker_paths import S3PathStrategy
from tierckpt.config import DurableLocation, S3Settings
from tierckpt.errors import StorageError

__all__ = ["SageMakerS3Sink", "dumps_metadata", "encode_items"]

_STORAGE_INFO_MODULE = "amzn_sagemaker_checkpointing.checkpointing.filesystem.storage_info"
_STORAGE_INFO_NAME = "_SageMakerStorageInfo"


def encode_items(items: list[WriteItem], planner: SavePlanner, rank: int) -> tuple[bytes, list[SageMakerStorageInfo]]:
    """One rank's ``checkpoint.pt`` and, per item in order, where it lies in it (as the library)."""
    buffer = io.BytesIO()
    infos: list[SageMakerStorageInfo] = []
    for item in items:
        offset = buffer.tell()
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            if not isinstance(data, io.BytesIO):
                raise TypeError(f"expected BytesIO for the bytes item {item.index.fqn!r}, got {type(data).__name__}")
            buffer.write(data.getbuffer())
        else:
            if not isinstance(data, torch.Tensor):
                raise TypeError(f"expected a tensor for {item.index.fqn!r}, got {type(data).__name__}")
            torch.save(data.detach().contiguous().cpu(), buffer)
        infos.append(SageMakerStorageInfo(rank=rank, offset=offset, length=buffer.tell() - offset))
    return buffer.getvalue(), infos


_PurePickler: Any = pickle._Pickler  # the pure-Python pickler, whose save_global a subclass can override


class _LibraryNamePickler(_PurePickler):  # type: ignore[misc]
    """Pickles ``SageMakerStorageInfo`` as the library's ``_SageMakerStorageInfo`` (same fields)."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is not SageMakerStorageInfo:
            super().save_global(obj, name)
            return
        self.save(_STORAGE_INFO_MODULE)
        self.save(_STORAGE_INFO_NAME)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def dumps_metadata(metadata: Metadata) -> bytes:
    """``metadata`` (storage data: ``SageMakerStorageInfo``) as the library pickles it."""
    out = io.BytesIO()
    _LibraryNamePickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(metadata)
    return out.getvalue()


class SageMakerS3Sink:
    """Puts one namespace's objects where ``strategy`` (default or Ray layout) names them."""

    def __init__(self, strategy: S3PathStrategy, namespace: str, s3: S3Settings | None = None) -> None:
        from tierckpt.tiers.s3 import make_client

        location = DurableLocation.parse(str(strategy.base_path).rstrip("/"))
        if location.scheme != "s3" or location.bucket is None:
            raise StorageError(f"{strategy.base_path!r} is not an s3:// path", tier="durable")
        self.strategy, self.namespace, self.bucket = strategy, namespace, location.bucket
        self.client = make_client(s3 or S3Settings())

    def uri(self, rank: int, step: int, filename: str) -> str:
        return self.strategy.get_s3_uri(self.namespace, rank, step, filename)

    def put(self, rank: int, step: int, filename: str, data: bytes) -> str:
        """Write one object; returns its URI. Failures are ``StorageError`` (tier ``durable``)."""
        uri = self.uri(rank, step, filename)
        key = uri[len(f"s3://{self.bucket}/") :]
        try:
            self.client.upload_fileobj(io.BytesIO(data), self.bucket, key)  # multipart when large
        except Exception as exc:  # botocore raises many types; all mean the put failed
            raise StorageError(f"writing {uri} failed: {exc}", tier="durable", step=step) from exc
        return uri
