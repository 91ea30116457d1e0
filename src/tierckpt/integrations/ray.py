"""Ray Train: tierckpt's durable steps as ``ray.train.Checkpoint`` objects, and back.

The Ray layout: the durable tier lives inside the Ray run's experiment directory, so every
durable step ``<storage_path>/<run name>/<namespace>/step_N`` is a checkpoint Ray Train manages
(it lists, restores and prunes it) without copying a byte; tierckpt wrote it with its own
multipart uploads and marker-last commit. Inside a ``TorchTrainer`` training function:

    cfg = config_for_run(namespace="tierckpt")          # durable_url = the run's directory
    with tierckpt.Checkpointer(cfg) as ck:
        start = load_ray_checkpoint(ck, ray.train.get_checkpoint(), state)   # None on a fresh run
        for step in ...:
            ck.save(step, state)                        # memory tier, every step
            if step % 100 == 0:
                report(ck, step, state, {"loss": loss})  # durable + ray.train.report, no upload

Outside Ray Train (a notebook, an evaluation job), ``to_ray_checkpoint(cfg, step)`` gives a Ray
Checkpoint of any durable step (``.to_directory()`` downloads it as a plain DCP checkpoint) and
``step_of(checkpoint)`` names the step of a Ray checkpoint in this layout.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from tierckpt import layout
from tierckpt.checkpointer import Checkpointer
from tierckpt.config import CheckpointConfig
from tierckpt.errors import ConfigError

__all__ = ["config_for_run", "load_ray_checkpoint", "pyarrow_filesystem", "report", "step_of", "to_ray_checkpoint"]

_HINT = "pip install 'tierckpt[ray]'"


def _ray_train() -> Any:
    try:
        import ray.train
    except ImportError as exc:
        raise ConfigError(f"the Ray integration needs Ray Train: {_HINT}") from exc
    return ray.train


def pyarrow_filesystem(config: CheckpointConfig) -> tuple[Any, str]:
    """``(filesystem, root)``: a pyarrow filesystem and path for ``config.durable_url``.

    S3 endpoint, credentials and region resolve as tierckpt's own S3 client resolves them
    (``config.s3`` first, then the standard AWS chain), so Ray reads what tierckpt wrote.
    """
    try:
        from pyarrow import fs as pafs
    except ImportError as exc:
        raise ConfigError(f"the Ray integration needs pyarrow: {_HINT}") from exc
    where = config.durable
    if where is None:
        raise ConfigError("a Ray checkpoint needs a durable tier: set durable_url in the CheckpointConfig")
    if where.scheme == "file":
        return pafs.LocalFileSystem(), str(where.path)
    import boto3

    from tierckpt.tiers.s3 import make_client

    settings = config.s3
    client = make_client(settings)  # endpoint and region exactly as tierckpt resolves them
    session = boto3.session.Session(
        profile_name=settings.profile, aws_access_key_id=settings.access_key_id,
        aws_secret_access_key=settings.secret_access_key, aws_session_token=settings.session_token,
    )
    creds = session.get_credentials()
    frozen = creds.get_frozen_credentials() if creds is not None else None
    options: dict[str, Any] = {"region": client.meta.region_name}
    if frozen is not None:
        options.update(access_key=frozen.access_key, secret_key=frozen.secret_key,
                       session_token=frozen.token)
    if config.s3.endpoint_url or not client.meta.endpoint_url.endswith("amazonaws.com"):
        endpoint = urlparse(client.meta.endpoint_url)
        options.update(endpoint_override=endpoint.netloc, scheme=endpoint.scheme or "https")
    return pafs.S3FileSystem(**options), f"{where.bucket}/{where.prefix}".rstrip("/")


def to_ray_checkpoint(config: CheckpointConfig, step: int, *, filesystem: Any = None) -> Any:
    """A ``ray.train.Checkpoint`` of durable ``step`` (it must be committed there)."""
    train = _ray_train()
    layout.validate_step(step)
    fs, root = pyarrow_filesystem(config)
    path = f"{root}/{config.namespace}/{layout.step_dir_name(step)}"
    return train.Checkpoint(path=path, filesystem=filesystem if filesystem is not None else fs)


def step_of(checkpoint: Any) -> int:
    """The step a Ray checkpoint in the tierckpt layout holds (its path ends in ``step_N``)."""
    step = layout.step_from_path(getattr(checkpoint, "path", checkpoint))
    if step is None:
        raise ConfigError(
            f"Ray checkpoint {getattr(checkpoint, 'path', checkpoint)!r} is not a tierckpt step "
            "(its path should end in '<namespace>/step_N'); it was not reported by tierckpt's report()"
        )
    return step


def load_ray_checkpoint(ck: Checkpointer, checkpoint: Any, state_dict: dict[str, Any]) -> int | None:
    """Load the step of ``checkpoint`` (``ray.train.get_checkpoint()``) in place; None for None.

    The step is read through the tiers: from this node's memory tier when it still holds it
    (a restarted worker on the same node), else from the durable copy Ray reported.
    """
    if checkpoint is None:
        return None
    return ck.load(state_dict, step=step_of(checkpoint))


def config_for_run(*, namespace: str = "tierckpt", **fields: Any) -> CheckpointConfig:
    """Inside a Ray Train worker: a config whose durable tier is this run's experiment directory.

    ``fields`` are the other ``CheckpointConfig`` fields (memory_dir, s3, durable_every_n_steps...).
    """
    train = _ray_train()
    storage = train.get_context().get_storage()
    fs_type = type(storage.storage_filesystem).__name__
    if fs_type == "LocalFileSystem":
        url = f"file://{storage.experiment_fs_path}"
    elif fs_type == "S3FileSystem":
        url = f"s3://{storage.experiment_fs_path}"
    else:
        raise ConfigError(f"Ray storage on {fs_type} is not a tierckpt durable tier; use s3:// or a local path")
    return CheckpointConfig(namespace=namespace, durable_url=url, **fields)


def report(ck: Checkpointer, step: int, state_dict: dict[str, Any], metrics: dict[str, Any]) -> None:
    """Save ``step`` durably, wait for its commit, then ``ray.train.report`` it (every rank calls).

    Ray gets a checkpoint pointing at the durable step (``NO_UPLOAD``: tierckpt already wrote it
    inside the run directory); rank 0 passes the checkpoint, the others report metrics only.
    """
    train = _ray_train()
    from ray.train import CheckpointUploadMode

    ck.save(step, state_dict, durable=True).result()
    storage = train.get_context().get_storage()
    checkpoint = to_ray_checkpoint(ck.config, step, filesystem=storage.storage_filesystem) if ck.rank == 0 else None
    train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
