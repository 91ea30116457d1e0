"""Lightning + tierckpt: a tiny model trained by ``Trainer`` with its checkpoints in the tiers.

    python examples/lightning_train.py --namespace demo --durable-url file:///tmp/ckpt --epochs 4
    python examples/lightning_train.py ... --kill-at-step 4    # SIGKILL itself once step 4 is saved
    python examples/lightning_train.py ...                     # run again: resumes from step 4
    python examples/lightning_train.py ... --async-save        # saves through AsyncCheckpointIO

Every epoch (2 optimizer steps) ModelCheckpoint saves through ``TierckptCheckpointIO``; a rerun
resumes from the newest loadable step (memory tier first, durable after). ``--out FILE`` writes
the final model and optimizer state and the step resumed from (the test compares them bitwise).
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
from typing import Any

import torch

import tierckpt
from tierckpt.integrations.lightning import TierckptCheckpointIO

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
except ImportError:
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from pytorch_lightning.plugins.io import AsyncCheckpointIO  # type: ignore[no-redef]


class TinyRegressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class KillAtStep(pl.Callback):
    """SIGKILL this process at the start of the batch after ``step`` (its checkpoint is saved)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # unset: tierckpt run's --namespace / --memory-dir / --durable-url (else /dev/shm/tierckpt, memory only)
    p.add_argument("--namespace", default=None, help="required unless run under tierckpt run --namespace")
    p.add_argument("--memory-dir", default=None)
    p.add_argument("--durable-url", default=None)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--devices", type=int, default=1, help="CPU processes (DDP over gloo when > 1)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(1)  # bitwise-reproducible runs, so a resumed run can be compared
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=False)  # 2 steps per epoch
    model = TinyRegressor()

    given = {"namespace": args.namespace, "memory_dir": args.memory_dir, "durable_url": args.durable_url}
    cfg = tierckpt.CheckpointConfig(**{k: v for k, v in given.items() if v is not None}, durable_every_n_steps=2)
    io = TierckptCheckpointIO(cfg)
    plugin = AsyncCheckpointIO(io) if args.async_save else io
    with tempfile.TemporaryDirectory() as scratch:  # ModelCheckpoint wants a dirpath; nothing lands there
        callbacks: list[Any] = [pl.callbacks.ModelCheckpoint(dirpath=scratch, every_n_epochs=1, save_top_k=-1)]
        if args.kill_at_step is not None:
            callbacks.append(KillAtStep(args.kill_at_step))
        trainer = pl.Trainer(
            max_epochs=args.epochs, accelerator="cpu", devices=args.devices, plugins=[plugin], callbacks=callbacks,
            strategy="ddp" if args.devices > 1 else "auto",
            logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=scratch,
            num_sanity_val_steps=0,
        )
        trainer.fit(model, train_dataloaders=loader, ckpt_path=io.resume_path())
    print(f"rank {trainer.global_rank}: resumed from step {io.loaded_step}; saved steps {io.saved_steps}; "
          f"global step {trainer.global_step}")
    if args.out and trainer.is_global_zero:
        optimizer = trainer.optimizers[0]
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "resumed_from": io.loaded_step, "saved_steps": io.saved_steps,
                    "global_step": trainer.global_step}, args.out)


if __name__ == "__main__":
    main()
