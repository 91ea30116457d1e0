"""In-process restarts of a ``torch.compile``d model under ``tierckpt run`` (docs/launcher.md).

    tierckpt run --nproc-per-node 2 --namespace demo examples/inprocess_compiled.py

The model is built and compiled once per process, outside the function ``tierckpt.resilient``
restarts: on a NaN loss, an exception in any rank or a hang the launcher detects, every rank
leaves the step, the process group is rebuilt, the state rolls back from this node's memory
tier, and training goes on with the compiled graph it already has.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import tierckpt
import tierckpt.monitor as monitor

STEPS = 200


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    compiled = torch.compile(model)  # compiled once: every in-process restart reuses it

    def train(gen: tierckpt.Generation) -> None:
        # a fresh process group for this generation is already initialised
        if gen.index:
            print(f"rank {gen.rank}: in-process restart {gen.index} after {gen.reason}", flush=True)
        with tierckpt.Checkpointer(tierckpt.CheckpointConfig.from_env(namespace="demo")) as ck:
            state = {"model": model.state_dict(), "optim": optim.state_dict()}
            start = ck.load(state) or 0  # a memcpy from this node's memory tier
            for step in range(start + 1, STEPS + 1):
                g = torch.Generator().manual_seed(step)
                x, y = torch.randn(64, 32, generator=g), torch.randint(0, 8, (64,), generator=g)
                loss = torch.nn.functional.cross_entropy(compiled(x), y)
                optim.zero_grad()
                loss.backward()
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
                optim.step()
                monitor.step(step, loss=loss.item())  # a NaN/Inf raises here: an in-process restart
                ck.save(step, {"model": model.state_dict(), "optim": optim.state_dict()})

    tierckpt.resilient(train)()


if __name__ == "__main__":
    main()
