"""A training loop whose only tierckpt calls are DCP saves (``python -m tests.launcher.saves_only``):
no ``monitor.step``, no ``Checkpointer``, no output a log rule matches. Under ``tierckpt run`` its
saves are its progress (issue 24, item 4).

    --writer sagemaker   ``tierckpt.compat.sagemaker.SageMakerTieredStorageWriter`` (the seed drop-in)
    --writer tiered      ``dcp.save(..., storage_writer=tierckpt.TieredStorageWriter(...))``

Each rank appends ``{"event": "step", "step": N, "pid": ...}`` to ``<workdir>/trace_rank<r>.jsonl`` after the
save of step N, and ``{"event": "done"}`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-time", type=float, default=0.25)
    p.add_argument("--writer", choices=("sagemaker", "tiered"), default="tiered")
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import tierckpt

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    trace = Path(args.workdir) / f"trace_rank{rank}.jsonl"
    (Path(args.workdir) / f"pid_rank{rank}").write_text(str(os.getpid()))
    ns, memory_dir = os.environ["TIERCKPT_NAMESPACE"], os.environ["TIERCKPT_MEMORY_DIR"]
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, args.steps + 1):
        time.sleep(args.step_time)
        loss = model(torch.full((4, 16), float(step % 7))).square().mean()
        loss.backward()
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
        optim.step()
        optim.zero_grad()
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        if args.writer == "sagemaker":
            from tierckpt.compat.sagemaker import SageMakerCheckpointConfig, SageMakerTieredStorageWriter

            cfg = SageMakerCheckpointConfig(namespace=ns, world_size=world, memory_dir=memory_dir)
            dcp.save(state, storage_writer=SageMakerTieredStorageWriter(checkpoint_config=cfg, step=step))
        else:
            config = tierckpt.CheckpointConfig(namespace=ns, memory_dir=memory_dir)
            dcp.save(state, storage_writer=tierckpt.TieredStorageWriter(config, step=step))
        with trace.open("a") as f:
            f.write(json.dumps({"event": "step", "step": step, "pid": os.getpid(),
                                "generation": int(os.environ.get("TIERCKPT_GENERATION", "0"))}) + "\n")
    with trace.open("a") as f:
        f.write(json.dumps({"event": "done", "pid": os.getpid()}) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
