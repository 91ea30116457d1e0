"""Ray Train + tierckpt: a TorchTrainer whose checkpoints are tierckpt steps in the run directory.

    python examples/ray_train.py --storage-path /tmp/ray-results --steps 8
    AWS_ENDPOINT_URL=http://127.0.0.1:8333 python examples/ray_train.py --storage-path s3://bucket/ray --fail-at 5

Every step is saved to the memory tier; every ``--report-every`` steps ``report`` makes the step
durable inside Ray's run directory and hands Ray a checkpoint that points at it (no upload by
Ray). ``--fail-at N`` raises in the training function once: Ray restarts the worker group, and
the new workers resume from ``ray.train.get_checkpoint()`` through the tiers (this node's memory
tier first). Starts a local Ray instance unless ``RAY_ADDRESS`` names one.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import tierckpt
from tierckpt.integrations.ray import config_for_run, load_ray_checkpoint, pyarrow_filesystem, report, step_of


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    """One step on a batch that depends only on the step, so a resumed run repeats the same data."""
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def train_func(config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker (a torch process group is already up)."""
    import ray.train

    model, optimizer = make_model()
    # durable only when reported (report() forces it); the memory tier takes every step
    memory = {"memory_dir": config["memory_dir"]} if config["memory_dir"] else {}  # unset: TIERCKPT_MEMORY_DIR or default
    cfg = config_for_run(namespace="tierckpt", durable_every_n_steps=1_000_000, **memory)
    with tierckpt.Checkpointer(cfg) as ck:
        # get_state_dict creates the optimizer state (momentum buffers) a fresh optimizer lacks:
        # a load template without those keys would silently leave them out of the resume
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        resumed = load_ray_checkpoint(ck, ray.train.get_checkpoint(), state)
        if resumed is not None:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for step in range(0 if resumed is None else resumed + 1, config["steps"]):
            loss = train_step(model, optimizer, step)
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            if step % config["report_every"] == 0 or step == config["steps"] - 1:
                report(ck, step, state, {"loss": loss, "step": step, "resumed_from": resumed})
            else:
                ck.save(step, state)
            if step == config["fail_at"] and resumed is None:
                raise RuntimeError(f"injected failure at step {step}")


def run(storage_path: str, *, steps: int, report_every: int, fail_at: int, memory_dir: str | None,
        name: str = "tierckpt-ray") -> Any:
    """Fit a 1-worker TorchTrainer; the ``ray.train.Result``."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    filesystem = None
    if storage_path.startswith("s3://"):  # the endpoint and credentials tierckpt resolves (AWS_*)
        probe = tierckpt.CheckpointConfig(namespace="probe", durable_url=storage_path)
        filesystem, storage_path = pyarrow_filesystem(probe)
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"steps": steps, "report_every": report_every, "fail_at": fail_at, "memory_dir": memory_dir},
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False),
        run_config=RunConfig(name=name, storage_path=storage_path, storage_filesystem=filesystem,
                             failure_config=FailureConfig(max_failures=1)),
    )
    return trainer.fit()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--storage-path", default=os.path.join(tempfile.gettempdir(), "ray-results"))
    p.add_argument("--memory-dir", default=None, help="default: $TIERCKPT_MEMORY_DIR, else /dev/shm/tierckpt")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--report-every", type=int, default=2)
    p.add_argument("--fail-at", type=int, default=-1)
    args = p.parse_args()
    result = run(args.storage_path, steps=args.steps, report_every=args.report_every, fail_at=args.fail_at,
                 memory_dir=args.memory_dir)
    print(f"final checkpoint: {result.checkpoint.path} (step {step_of(result.checkpoint)}); metrics {result.metrics}")


if __name__ == "__main__":
    main()
