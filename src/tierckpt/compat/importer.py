"""``tierckpt import``: convert checkpoints the SageMaker library wrote into tierckpt steps.

    tierckpt import s3://bucket/checkpoints --source-namespace job-1 --to s3://bucket/tierckpt
        [--layout default|ray] [--to-namespace NS] [--step N ...] [--trust-objects] [--dry-run]

For each complete step of the source (``tierckpt.compat.legacy``: metadata plus every rank's
``checkpoint.pt``, in the ``DefaultS3PathStrategy`` or ``RayS3PathStrategy`` layout), the whole
checkpoint is read into memory in this process (shards of several ranks are consolidated into
full tensors) and saved as one tierckpt step of the same number under ``--to`` (``file://`` or
``s3://``): plain DCP plus manifest and marker, loadable with any world size. Steps the
destination already holds are skipped, so the command can be re-run. Non-tensor values are
restored with ``torch.load(weights_only=True)`` (numbers, strings, containers, tensors);
``--trust-objects`` allows any pickled class, which runs code from the checkpoint.

Call order: ``add_arguments(parser)`` when the CLI builds its parser; ``main(args)`` runs it and
returns the exit code (0 converted or nothing to do, 3 no such step, TierckptError codes).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "convert_step", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``import`` subcommand's arguments."""
    parser.description = "Convert checkpoints written by amzn-sagemaker-checkpointing on S3 into tierckpt steps."
    parser.add_argument("source", help="the SageMaker s3_tier_base_path, s3://bucket/prefix")
    parser.add_argument("--source-namespace", required=True, help="the SageMakerCheckpointConfig namespace")
    parser.add_argument("--layout", choices=["default", "ray"], default="default",
                        help="the S3PathStrategy the checkpoints were written with (default: rank_R/step_N)")
    parser.add_argument("--to", dest="to_url", required=True, help="tierckpt durable_url: file:///path or s3://bucket/prefix")
    parser.add_argument("--to-namespace", help="tierckpt namespace of the converted steps (default: the source's)")
    parser.add_argument("--step", dest="steps", type=int, action="append",
                        help="convert only this step (repeatable); default: every complete step")
    parser.add_argument("--trust-objects", action="store_true",
                        help="unpickle any non-tensor value (runs code from the checkpoint; only for trusted data)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be converted, change nothing")


def main(args: argparse.Namespace) -> int:
    """Run ``tierckpt import``; TierckptErrors propagate to the CLI, which maps them to exit codes."""
    from tierckpt.compat.legacy import LegacySource
    from tierckpt.compat.sagemaker_paths import DefaultS3PathStrategy, RayS3PathStrategy
    from tierckpt.config import CheckpointConfig, S3Settings, validate_namespace
    from tierckpt.errors import CheckpointNotFoundError
    from tierckpt.tiers import open_durable

    namespace = validate_namespace(args.source_namespace)
    strategy = (RayS3PathStrategy if args.layout == "ray" else DefaultS3PathStrategy)(args.source.rstrip("/"))
    source = LegacySource(strategy, namespace, S3Settings())
    found = source.step_ranks()
    wanted = sorted(found) if not args.steps else sorted(set(args.steps))
    missing = [s for s in wanted if s not in found]
    if missing:
        raise CheckpointNotFoundError(
            f"step(s) {missing} not found under {args.source}/{namespace} in the {args.layout} layout "
            f"(found: {sorted(found) or 'none'})", step=missing[0],
        )
    config = CheckpointConfig(namespace=args.to_namespace or namespace, durable_url=args.to_url,
                              memory_steps_retained=1, durable_every_n_steps=0)
    durable = open_durable(config)
    have: set[int] = set()
    if durable is not None:
        try:  # only to list what is there already: the conversion opens its own tiers
            have = {s.step for s in durable.list_steps()}
        finally:
            closer = getattr(durable, "close", None)
            if closer is not None:
                closer()
    converted = 0
    for step in wanted:
        if step in have:
            print(f"step {step}: already in {config.durable_url} (namespace {config.namespace}); skipped")
            continue
        metadata = source.metadata(step)
        if metadata is None or not {i.rank for i in metadata.storage_data.values()} <= found[step]:
            print(f"step {step}: incomplete (no metadata or a rank's {strategy.get_s3_uri(namespace, 0, step, '')}"
                  "checkpoint.pt is missing); skipped")
            continue
        if args.dry_run:
            print(f"step {step}: would convert {len(metadata.state_dict_metadata)} entries to {config.durable_url}")
            continue
        nbytes = convert_step(source, step, metadata, config, trust_objects=args.trust_objects)
        converted += 1
        print(f"step {step}: converted {len(metadata.state_dict_metadata)} entries ({nbytes / 2**20:.1f} MiB) "
              f"to {config.durable_url} namespace {config.namespace}")
    print(f"{converted} step(s) converted")
    return 0


def convert_step(source: Any, step: int, metadata: Any, config: Any, *, trust_objects: bool = False) -> int:
    """Read one source step whole and save it as tierckpt step ``step`` (memory, then durable).

    The memory tier used on the way is a private temporary directory, removed afterwards.
    Returns the tensor bytes converted.
    """
    import warnings

    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from tierckpt.compat.legacy import LegacyStepReader, SafeLoadPlanner
    from tierckpt.dcp.writer import TieredStorageWriter
    from tierckpt.runtime import RankRuntime

    state: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            state[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        else:
            state[fqn] = None  # a bytes entry: the planner puts the loaded object here
    shm = Path("/dev/shm")
    scratch = tempfile.mkdtemp(prefix="tierckpt-import-", dir=str(shm) if shm.is_dir() else None)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(state, storage_reader=LegacyStepReader(source, step, metadata),
                     planner=SafeLoadPlanner(trust_objects=trust_objects), no_dist=True)
            cfg = config.replace(memory_dir=scratch)
            runtime = RankRuntime(cfg, 0)
            try:
                dcp_save(state, storage_writer=TieredStorageWriter(cfg, step=step, durable=True, _runtime=runtime),
                         no_dist=True)
            finally:
                runtime.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
