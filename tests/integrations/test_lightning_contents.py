"""What users put in Lightning checkpoints, through a real ``Trainer`` in this process.

Hyper-parameters holding a ``Path``, an ``argparse.Namespace`` and a ``datetime`` save and
resume; ``weights_only=False`` (as Lightning passes it) loads any object; an object no resume
could load is refused when it is saved, naming its key; ``ckpt_path="last"`` with
``save_last=True`` resumes the newest committed step; saves and loads report ``tierckpt_*`` metrics.
"""

from __future__ import annotations

import argparse
import datetime
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("pytorch_lightning")

import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import tierckpt.metrics  # noqa: E402
from tierckpt import CheckpointConfig, UnsafeObjectError, UnsaveableObjectError  # noqa: E402
from tierckpt.integrations.lightning import LATEST, TierckptCheckpointIO  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"),  # Lightning vs torch 2.13
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),  # as with Lightning's own files
    pytest.mark.filterwarnings("ignore:The `srun` command is available on your system"),  # a machine with Slurm's client
]


class Opaque:
    """A user's own class: not on any allow-list."""

    def __init__(self, value: int) -> None:
        self.value = value


class HParamsModel(pl.LightningModule):
    def __init__(self, out_dir: Path, args: argparse.Namespace, started: datetime.datetime, extra: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)), batch_size=4)


HPARAMS: dict[str, Any] = {
    "out_dir": Path("/data/run-1"),
    "args": argparse.Namespace(lr=0.1, data=Path("/data/train")),
    "started": datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc),
}


def trainer(io: TierckptCheckpointIO, ckpt_dir: Path, epochs: int) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=epochs, plugins=[io], accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(ckpt_dir.parent),
        callbacks=[ModelCheckpoint(dirpath=str(ckpt_dir), every_n_epochs=1, save_top_k=-1, save_last=True)],
    )


@pytest.fixture
def config(shm_root: Path) -> CheckpointConfig:
    return CheckpointConfig(namespace="lit-h", memory_dir=str(shm_root))


def test_hyper_parameters_with_path_namespace_datetime_resume_through_ckpt_path_last(
    config: CheckpointConfig, tmp_path: Path
) -> None:
    first = TierckptCheckpointIO(config)
    trainer(first, tmp_path / "ck", epochs=1).fit(HParamsModel(**HPARAMS))
    assert first.saved_steps == [2]

    io = TierckptCheckpointIO(config)  # the process after the crash
    model = HParamsModel(**HPARAMS)
    again = trainer(io, tmp_path / "ck", epochs=2)
    again.fit(model, ckpt_path="last")
    assert io.loaded_step == 2 and again.global_step == 4 and io.saved_steps == [4]

    checkpoint = TierckptCheckpointIO(config).load_checkpoint(LATEST)
    assert checkpoint["hyper_parameters"]["out_dir"] == HPARAMS["out_dir"]
    assert checkpoint["hyper_parameters"]["args"] == HPARAMS["args"]
    assert checkpoint["hyper_parameters"]["started"] == HPARAMS["started"]


def test_ckpt_path_last_names_the_newest_committed_step_even_from_an_older_name(config: CheckpointConfig, tmp_path: Path) -> None:
    io = TierckptCheckpointIO(config)
    trainer(io, tmp_path / "ck", epochs=2).fit(HParamsModel(**HPARAMS))
    last = tmp_path / "ck" / "last.ckpt"
    assert last.is_file() and last.stat().st_size < 512  # a pointer; the step is in the tiers
    loaded = TierckptCheckpointIO(config)
    assert loaded.load_checkpoint(str(last))["global_step"] == 4 and loaded.loaded_step == 4
    with pytest.raises(pickle.UnpicklingError):
        torch.load(last, weights_only=True)  # not a torch checkpoint: nothing mistakes it for one


def test_an_object_no_resume_could_load_is_refused_at_save_time_naming_its_key(config: CheckpointConfig) -> None:
    io = TierckptCheckpointIO(config)
    checkpoint = {"global_step": 3, "state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"cb": {"thing": Opaque(1)}}}
    with pytest.raises(UnsaveableObjectError, match=r"'hyper_parameters\.cb\.thing'.*Opaque.*trusted=True") as info:
        io.save_checkpoint(checkpoint, "epoch=0-step=3.ckpt")
    assert info.value.key == "hyper_parameters.cb.thing"
    assert io.saved_steps == []

    trusting = TierckptCheckpointIO(config.replace(trusted=True))  # the opt-in the message names
    trusting.save_checkpoint(checkpoint, "epoch=0-step=3.ckpt")
    with pytest.raises(UnsafeObjectError) as refused:
        TierckptCheckpointIO(config).load_checkpoint(LATEST)  # a reader without trust still refuses it
    assert not any("TensorRef" in n or "_Skeleton" in n for n in refused.value.names), refused.value.names
    assert any("Opaque" in n for n in refused.value.names)
    got = TierckptCheckpointIO(config).load_checkpoint(LATEST, weights_only=False)  # what Lightning passes
    assert got["hyper_parameters"]["cb"]["thing"].value == 1
    allowed = TierckptCheckpointIO(config.replace(allowed_classes=(Opaque,)))
    assert allowed.load_checkpoint(LATEST)["hyper_parameters"]["cb"]["thing"].value == 1


def _sample(name: str, **labels: str) -> float:
    m = tierckpt.metrics.library_metrics()
    assert m is not None
    for line in m.registry.render().splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_lightning_saves_and_loads_report_tierckpt_metrics(config: CheckpointConfig, tmp_path: Path) -> None:
    tierckpt.metrics.enable()
    try:
        io = TierckptCheckpointIO(config)
        trainer(io, tmp_path / "ck", epochs=2).fit(HParamsModel(**HPARAMS))
        assert _sample("tierckpt_saves_total", namespace="lit-h", tier="memory") == 2
        assert _sample("tierckpt_last_committed_step", namespace="lit-h", tier="memory") == 4
        assert _sample("tierckpt_save_bytes_total", namespace="lit-h", tier="memory") > 0
        TierckptCheckpointIO(config).load_checkpoint(LATEST)
        assert _sample("tierckpt_loads_total", namespace="lit-h", tier="memory") == 1  # one load, one count
        assert _sample("tierckpt_last_loaded_step", namespace="lit-h") == 4
    finally:
        tierckpt.metrics.disable()


def test_a_run_that_did_not_resume_is_told_before_it_saves_over_earlier_steps(
    config: CheckpointConfig, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint = {"global_step": 2, "state_dict": {"w": torch.ones(2)}}
    TierckptCheckpointIO(config).save_checkpoint(checkpoint, "epoch=0-step=2.ckpt")
    with caplog.at_level("WARNING", logger="tierckpt.integrations.lightning"):
        TierckptCheckpointIO(config).save_checkpoint(checkpoint, "epoch=0-step=2.ckpt")
    assert "already holds step(s) [2] from an earlier run" in caplog.text and "ckpt_path='tierckpt:latest'" in caplog.text
    caplog.clear()
    resumed = TierckptCheckpointIO(config)
    resumed.load_checkpoint(LATEST)
    with caplog.at_level("WARNING", logger="tierckpt.integrations.lightning"):
        resumed.save_checkpoint({**checkpoint, "global_step": 4}, "epoch=1-step=4.ckpt")
    assert "earlier run" not in caplog.text
