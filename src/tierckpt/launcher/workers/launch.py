"""Starting one generation's workers: their environment, and torch's process context around them.

Call order (the agent, at every (re)start): ``static_env`` (what every worker of every
generation gets), ``worker_envs`` (per local rank: torch elastic's variables plus the job-wide
generation and the generation's master), then ``start_context``: torch's ``SubprocessContext``
with ranks served by warm standbys where possible (``warm.py``), or torch's ``start_processes``
for a callable entrypoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from string import Template
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.multiprocessing import LogsSpecs, start_processes
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.elastic.utils.api import macros

from tierckpt import workerenv
from tierckpt.launcher.workers.warm import StandbyPool, WarmSubprocessContext

__all__ = ["start_context", "static_env", "worker_envs"]


def static_env(beat_dir: str, *, namespace: str | None = None, memory_dir: str | None = None,
               durable_url: str | None = None) -> dict[str, str]:
    """What every worker of every generation gets beside torch elastic's per-rank variables."""
    env = {workerenv.MONITOR_DIR: beat_dir, "PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1"),
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
           # a fresh store per generation (rank 0 hosts it on the published port)
           "TORCHELASTIC_USE_AGENT_STORE": "False"}
    for key, value in ((workerenv.NAMESPACE, namespace), (workerenv.MEMORY_DIR, memory_dir),
                       (workerenv.DURABLE_URL, durable_url)):
        if value:
            env[key] = value
    if "OMP_NUM_THREADS" in os.environ:
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    return env


def worker_envs(wg: WorkerGroup, *, generation: int, addr: str, port: int, static: dict[str, str],
                set_local_rank_env: Callable[[dict[str, str], int], None],
                ) -> tuple[dict[int, dict[str, str]], dict[int, tuple[Any, ...]]]:
    """Per local rank: (environment, argv) of generation ``generation``'s workers."""
    spec = wg.spec
    envs: dict[int, dict[str, str]] = {}
    args: dict[int, tuple[Any, ...]] = {}
    for w in wg.workers:
        env = {
            "RANK": str(w.global_rank), "GROUP_RANK": str(wg.group_rank),
            "ROLE_RANK": str(w.role_rank), "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.local_world_size), "WORLD_SIZE": str(w.world_size),
            "GROUP_WORLD_SIZE": str(wg.group_world_size), "ROLE_WORLD_SIZE": str(w.role_world_size),
            "MASTER_ADDR": addr, "MASTER_PORT": str(port), workerenv.GENERATION: str(generation),
            # the generation is the restart count: job-wide, never per agent (pytorch#135712)
            "TORCHELASTIC_RESTART_COUNT": str(generation), "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            workerenv.JOB_RESTART_COUNT: str(generation),  # hyperpodrun's name for it
            "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
            **static,
        }
        set_local_rank_env(env, w.local_rank)
        envs[w.local_rank] = env
        args[w.local_rank] = tuple(macros.substitute(list(spec.args), str(w.local_rank)))
    return envs, args


def start_context(wg: WorkerGroup, envs: dict[int, dict[str, str]], args: dict[int, tuple[Any, ...]], *,
                  logs_specs: LogsSpecs, prefix_template: str | None, pool: StandbyPool | None,
                  start_method: str) -> tuple[PContext, list[int]]:
    """Start the workers; (the process context, the local ranks a standby serves)."""
    spec = wg.spec
    prefixes = None
    if prefix_template:
        prefixes = {w.local_rank: Template(prefix_template).safe_substitute(
            role_name=spec.role, rank=w.global_rank, local_rank=w.local_rank) for w in wg.workers}
    if spec.entrypoint is None:
        raise RuntimeError("tierckpt run: the worker spec has no entrypoint")
    kw: dict[str, Any] = dict(name=spec.role, entrypoint=spec.entrypoint, args=args, envs=envs,
                              logs_specs=logs_specs, log_line_prefixes=prefixes,
                              duplicate_stdout_filters=spec.duplicate_stdout_filters,
                              duplicate_stderr_filters=spec.duplicate_stderr_filters,
                              numa_options=spec.numa_options)
    if not isinstance(spec.entrypoint, str):
        return start_processes(start_method=start_method, **kw), []
    # torch's SubprocessContext (polling, failures, logs, tee, kill by process group), with
    # ranks served by warm standbys where possible
    ctx = WarmSubprocessContext(pool=pool, **kw)
    try:
        ctx.start()
    except Exception:
        ctx.close()
        raise
    return ctx, list(ctx.warm_ranks)
