"""The demo's training job: a small MLP under DDP on CPU (gloo), checkpointed every step.

Run by ``tierckpt demo`` through torchrun. Each rank writes its pid (so the driver can
SIGKILL it), a digest of every state it saves (written before the save, so any step that
commits has one), and at the end a JSON result with what it resumed from and how long
saves blocked.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import tierckpt

NAMESPACE = "tierckpt-demo"


def digest(state: Any) -> str:
    """xxh3 of every tensor and value in a (nested) state dict, in key order."""
    h = xxhash.xxh3_128()

    def visit(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k in sorted(obj, key=str):
                visit(f"{prefix}/{k}", obj[k])
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                visit(f"{prefix}/{i}", v)
        elif isinstance(obj, torch.Tensor):
            h.update(prefix.encode())
            h.update(obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{prefix}={obj!r}".encode())

    visit("", state)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--memory-dir", required=True)
    args = ap.parse_args()
    work = Path(args.workdir)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    (work / "pids").mkdir(parents=True, exist_ok=True)
    (work / "digests").mkdir(parents=True, exist_ok=True)
    (work / "pids" / f"rank_{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                    torch.nn.ReLU(), torch.nn.Linear(512, 10)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = tierckpt.CheckpointConfig(
        namespace=NAMESPACE, memory_dir=args.memory_dir, durable_url=f"file://{(work / 'durable').resolve()}",
        durable_every_n_steps=5, memory_steps_retained=2,
    )
    result: dict[str, Any] = {"rank": rank, "resumed_from": None, "blocking_s": []}
    state: dict[str, Any]
    with tierckpt.Checkpointer(cfg) as ck:
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "meta": {"step": 0}}
        resumed = ck.load(state)
        start = 1
        if resumed is not None:
            expected = (work / "digests" / f"step_{resumed}_rank_{rank}").read_text()
            result.update(  # digest first: set_state_dict rewrites the dicts it is given
                resumed_from=resumed, load_s=ck.last_load["seconds"], load_tiers=ck.last_load["tiers"],
                state_matches=digest(state) == expected and state["meta"]["step"] == resumed,
            )
            set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
            start = resumed + 1
        for step in range(start, args.steps + 1):
            g = torch.Generator().manual_seed(step * 100 + rank)
            x, y = torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            msd, osd = get_state_dict(model, optim)
            state = {"model": msd, "optim": osd, "meta": {"step": step}}
            (work / "digests" / f"step_{step}_rank_{rank}").write_text(digest(state))
            handle = ck.save(step, state)
            result["blocking_s"].append(handle.blocking_s)
            (work / "pids" / f"progress_{rank}").write_text(str(step))
            time.sleep(0.1)  # a real step takes longer; this gives the driver a window to kill
        ck.wait()
        result["final_step"] = args.steps
        result["loss"] = float(loss.detach())
    result["median_blocking_s"] = statistics.median(result["blocking_s"]) if result["blocking_s"] else None
    (work / f"result_rank_{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
