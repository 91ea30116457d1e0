"""A plain training loop with FSDP2 (``fully_shard``) saving to the tiers; restart at any world size.

    torchrun --nproc-per-node 2 examples/fsdp2_train.py --namespace fsdp --durable-url file:///tmp/ckpt --steps 6
    torchrun --nproc-per-node 3 examples/fsdp2_train.py --namespace fsdp --durable-url file:///tmp/ckpt --steps 8

(``tierckpt run`` works in place of ``torchrun``: then ``--namespace``, ``--memory-dir`` and
``--durable-url`` may be left out here and the launcher's are used.) Each rank holds a shard of every parameter and
of the optimizer state (DTensors); ``Checkpointer.save`` copies the shards into shared memory and
returns, the durable copy follows every ``--durable-every`` steps. A restart with another world
size resumes from the newest step: DCP's planner reshards the DTensors on load. On CPU this runs
with gloo; on GPUs pass ``--device cuda`` (nccl is picked by ``init_process_group``).
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import tierckpt


def build(device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same model on every rank, then sharded over all ranks (FSDP2, one mesh dimension)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, device: str) -> float:
    """One step on a batch that depends only on the step (so any world size sees the same data)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, 16, generator=gen).to(device), torch.randn(8, 4, generator=gen).to(device)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Unsharded model and optimizer state on CPU (a collective; every rank gets it)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False)
    return {"model": get_model_state_dict(model, options=opts),
            "optim": get_optimizer_state_dict(model, optimizer, options=opts)}


def run(cfg: tierckpt.CheckpointConfig, steps: int, *, device: str = "cpu") -> dict[str, Any]:
    """Resume from the newest step (if any), train up to ``steps``, saving every step.

    Returns the step resumed from and the tiers it was read from, the full state right after the
    resume (before any training) and at the end, as the test compares them across world sizes.
    """
    model, optimizer = build(device)
    with tierckpt.Checkpointer(cfg) as ck:
        model_sd, optim_sd = get_state_dict(model, optimizer)  # sharded: DTensors
        state = {"model": model_sd, "optim": optim_sd, "extra": {"step": torch.zeros((), dtype=torch.int64)}}
        resumed = ck.load(state)
        if resumed is not None:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = resumed + 1 if resumed is not None else 0
        # a deep copy: scalar optimizer tensors ("step") come back as the live tensors themselves
        at_resume = copy.deepcopy(full_state(model, optimizer)) if resumed is not None else None
        tiers = ck.last_load.get("tiers")
        for step in range(start, steps):
            train_step(model, optimizer, step, device)
            model_sd, optim_sd = get_state_dict(model, optimizer)
            ck.save(step, {"model": model_sd, "optim": optim_sd,
                           "extra": {"step": torch.tensor(step, dtype=torch.int64)}})
        ck.wait()
    return {"resumed": resumed, "tiers": tiers, "at_resume": at_resume, "final": full_state(model, optimizer)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # unset: tierckpt run's --namespace / --memory-dir / --durable-url (else /dev/shm/tierckpt, memory only)
    p.add_argument("--namespace", default=None, help="required unless run under tierckpt run --namespace")
    p.add_argument("--memory-dir", default=None)
    p.add_argument("--durable-url", default=None)
    p.add_argument("--durable-every", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        given = {"namespace": args.namespace, "memory_dir": args.memory_dir, "durable_url": args.durable_url}
        cfg = tierckpt.CheckpointConfig(**{k: v for k, v in given.items() if v is not None},
                                        durable_every_n_steps=args.durable_every)
        out = run(cfg, args.steps, device=args.device)
        if dist.get_rank() == 0:
            print(f"world {dist.get_world_size()}: resumed from {out['resumed']}, trained to step {args.steps - 1}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
