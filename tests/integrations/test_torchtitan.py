"""torchtitan's CheckpointManager over the tiers, and the adapter it uses, on real gloo ranks.

The adapter test needs no torchtitan: ``tiered_save`` / ``tiered_load`` are called exactly as
torchtitan's ``dcp_save`` / ``dcp_load`` call ``dcp.save`` / ``dcp.async_save`` / ``dcp.load``
(``<folder>/step-N`` ids, its gloo group for async saves). The manager test runs torchtitan's own
``CheckpointManager`` (its interval, async mode, state flattening, OptimizersContainer and
LRSchedulersContainer) on a tiny model, CPU, 2 ranks; it skips when torchtitan is absent.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_ranks


def _state(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"layers.0.weight": torch.randn(32, 16, generator=g), "train_state": {"step": step}}


def _adapter(rank: int, memory_dir: str, durable_url: str) -> list[int]:
    import torch.distributed as dist

    import tierckpt
    from tierckpt.integrations.torchtitan import newest_step, tiered_load, tiered_save

    cfg = tierckpt.CheckpointConfig(namespace="titan-adapter", memory_dir=memory_dir, durable_url=durable_url,
                                    durable_every_n_steps=4)
    assert newest_step(cfg) == -1
    pg = dist.new_group(backend="gloo")  # torchtitan's own group for async saves
    tiered_save(cfg, _state(2, rank), "outputs/checkpoint/step-2")
    fut = tiered_save(cfg, _state(4, rank), "outputs/checkpoint/step-4", mode="async", process_group=pg)
    fut.result()
    pinned = tiered_save(cfg, _state(6, rank), "outputs/checkpoint/step-6", mode="async_with_pinned_mem",
                         process_group=pg)
    assert pinned.staging_completion.done()
    pinned.upload_completion.result()
    got = {"layers.0.weight": torch.zeros(32, 16), "train_state": {"step": -1}}
    tiered_load(cfg, got, "outputs/checkpoint/step-4")
    try:
        tiered_load(cfg, got, "outputs/checkpoint/step-3")
        raise AssertionError("step 3 was never saved")
    except tierckpt.CheckpointNotFoundError:
        pass  # a typed error, not DCP's CheckpointException (a BaseException)
    want = _state(4, 0)  # rank 0's tensor: DCP stores one copy of a replicated (plain) tensor
    assert torch.equal(got["layers.0.weight"], want["layers.0.weight"]) and got["train_state"]["step"] == 4
    return [newest_step(cfg)]


@pytest.mark.slow  # 20-33 s on the loaded 2-core box: a fresh interpreter with torch, or a seed round-trip
def test_adapter_saves_and_loads_as_torchtitan_calls_dcp(shm_root: Path, durable_dir: Path) -> None:
    results = run_ranks(_adapter, 2, str(shm_root), f"file://{durable_dir}", timeout=120)
    assert results == [[6], [6]]
    durable = sorted(p.name for p in (durable_dir / "titan-adapter").iterdir() if p.name.startswith("step_"))
    assert durable == ["step_4"]  # durable every 4 steps; memory every save


def _titan(rank: int, memory_dir: str, durable_url: str, steps: int, async_mode: str) -> dict[str, Any]:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, default_adamw

    import tierckpt
    from tierckpt.integrations.torchtitan import TierckptCheckpointManager

    class TrainState(torch.distributed.checkpoint.stateful.Stateful):
        def __init__(self) -> None:
            self.step = 0

        def state_dict(self) -> dict[str, Any]:
            return {"step": torch.tensor(self.step)}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.step = int(sd["step"])

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizers = OptimizersContainer(default_adamw(lr=1e-2), model_parts=[model])
    schedulers = LRSchedulersContainer(optimizers, lambda step: 1.0 / (1 + step))
    train_state = TrainState()
    tiers = tierckpt.CheckpointConfig(namespace="titan", memory_dir=memory_dir, durable_url=durable_url,
                                      durable_every_n_steps=4, memory_steps_retained=2)
    manager = TierckptCheckpointManager(
        CheckpointManager.Config(enable=True, interval=2, async_mode=async_mode, last_save_model_only=False,
                                 keep_latest_k=0),
        tiers=tiers, dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": train_state}, sd_adapter=None,
    )
    resumed = manager.load()
    at_resume = copy.deepcopy({"model": model.state_dict(), "step": train_state.step, "optim": optimizers.state_dict(),
                               "lr": schedulers.schedulers[0].last_epoch})
    while train_state.step < steps:
        train_state.step += 1
        g = torch.Generator().manual_seed(train_state.step)
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 1, generator=g))
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        manager.save(train_state.step, last_step=train_state.step == steps)
    manager.maybe_wait_for_saving()
    manager.close()
    final = copy.deepcopy({"model": model.state_dict(), "step": train_state.step, "optim": optimizers.state_dict()})
    buf = io.BytesIO()
    torch.save({"resumed": resumed, "at_resume": at_resume, "final": final}, buf)
    return {"blob": buf.getvalue()} if rank == 0 else {}


@pytest.mark.slow
def test_torchtitan_checkpoint_manager_resumes_from_the_tiers(shm_root: Path, durable_dir: Path) -> None:
    pytest.importorskip("torchtitan")
    url = f"file://{durable_dir}"
    first = run_ranks(_titan, 2, str(shm_root), url, 6, "async", timeout=150)[0]
    first = torch.load(io.BytesIO(first["blob"]), weights_only=False)
    assert first["resumed"] is False and first["final"]["step"] == 6
    durable = sorted(p.name for p in (durable_dir / "titan").iterdir() if p.name.startswith("step_"))
    assert durable == ["step_4"]  # torchtitan's interval 2 into memory, durable every 4
    assert sorted(p.name for p in (shm_root / "titan").iterdir() if p.name.startswith("step_")) == ["step_4", "step_6"]

    second = run_ranks(_titan, 2, str(shm_root), url, 6, "disabled", timeout=150)[0]
    second = torch.load(io.BytesIO(second["blob"]), weights_only=False)
    assert second["resumed"] is True
    assert second["at_resume"]["step"] == 6 and second["at_resume"]["lr"] == 6  # train state, scheduler
    _assert_equal(second["at_resume"]["model"], first["final"]["model"])
    _assert_equal(second["at_resume"]["optim"], first["final"]["optim"])


def _assert_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}.{key}")
    else:
        assert a == b, where


def test_adapter_saves_and_loads_report_tierckpt_metrics(shm_root: Path, tmp_path: Path) -> None:
    import tierckpt
    import tierckpt.metrics
    from tierckpt.integrations.torchtitan import tiered_load, tiered_save

    def sample(name: str, **labels: str) -> float:
        m = tierckpt.metrics.library_metrics()
        assert m is not None
        for line in m.registry.render().splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    cfg = tierckpt.CheckpointConfig(namespace="titan-m", memory_dir=str(shm_root), durable_url=f"file://{tmp_path}",
                                    durable_every_n_steps=4)
    tierckpt.metrics.enable()
    try:
        tiered_save(cfg, _state(2, 0), "outputs/checkpoint/step-2")
        tiered_save(cfg, _state(4, 0), "outputs/checkpoint/step-4")
        assert sample("tierckpt_saves_total", namespace="titan-m", tier="memory") == 2
        assert sample("tierckpt_saves_total", namespace="titan-m", tier="durable") == 1
        assert sample("tierckpt_last_committed_step", namespace="titan-m", tier="durable") == 4
        assert sample("tierckpt_save_bytes_total", namespace="titan-m", tier="durable") >= 32 * 16 * 4
        state = _state(0, 0)
        tiered_load(cfg, state, "outputs/checkpoint/step-2")
        assert torch.equal(state["layers.0.weight"], _state(2, 0)["layers.0.weight"])
        assert sample("tierckpt_loads_total", namespace="titan-m", tier="memory") == 1
        assert sample("tierckpt_last_loaded_step", namespace="titan-m") == 2
    finally:
        tierckpt.metrics.disable()
