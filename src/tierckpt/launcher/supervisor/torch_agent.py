"""The per-node agent of ``tierckpt run`` as torch elastic sees it: a LocalElasticAgent whose template
hooks each delegate to the supervisor (loop.py), which runs the monitor loop and the recoveries.

Call order: cli.py builds ``TierckptAgent(spec, logs_specs, opts, reaper=...)``, calls torch's
``run()``, which calls ``_invoke_run`` → ``Supervisor.run``; inside it torch's ``_rendezvous``
(``torch_rendezvous``) calls ``_assign_worker_ranks`` (→ ``Rounds.assign``: the node's stable
rank), and every (re)start goes through ``_start_workers`` (→ ``Supervisor.start_workers``),
whose last step before the processes start is ``torch_watchdogs`` (torchrun's file-timer watchdog
and health-check server). cli.py calls ``close()`` at the end whatever happened.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs

from tierckpt.launcher.options import RunOptions
from tierckpt.launcher.supervisor.loop import Supervisor
from tierckpt.launcher.workers.reaper import Reaper
from tierckpt.launcher.workers.watchdog import start_watchdog

__all__ = ["TierckptAgent"]


class TierckptAgent(LocalElasticAgent):
    """torch's hooks, each delegating to the ``Supervisor``; see the module doc."""

    def __init__(self, spec: WorkerSpec, logs_specs: LogsSpecs, opts: RunOptions, *,
                 start_method: str = "spawn", log_line_prefix_template: str | None = None,
                 shutdown_timeout: int = 30, reaper: Reaper | None = None) -> None:
        super().__init__(spec, logs_specs, start_method=start_method,
                         log_line_prefix_template=log_line_prefix_template, shutdown_timeout=shutdown_timeout)
        self.supervisor = Supervisor(self, opts, reaper=reaper)

    @property
    def exit_code(self) -> int:
        return self.supervisor.exit_code

    @property
    def failure(self) -> str | None:
        """The one-line reason of a LAUNCHER_ERROR_EXIT (cli.py prints it)."""
        return self.supervisor.failure

    # ---- torch's template hooks ----
    def _invoke_run(self, role: str = "default") -> RunResult:
        return self.supervisor.run()

    def _assign_worker_ranks(self, store: Any, group_rank: int, group_world_size: int,
                             spec: WorkerSpec) -> list[Any]:
        """torch's rank assignment, but from the group rank this node held before (membership/rounds.py)
        instead of torch's arrival order; called by torch's ``_rendezvous`` once per round."""
        stable = self.supervisor.rounds.assign(store, group_rank, group_world_size, spec.rdzv_handler.get_run_id(),
                                               spec.rdzv_handler)
        return super()._assign_worker_ranks(store, stable, group_world_size, spec)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        return self.supervisor.start_workers(worker_group)

    # ---- what the supervisor calls of torch ----
    def torch_rendezvous(self, wg: WorkerGroup) -> None:
        """torch's rendezvous round (it calls ``_assign_worker_ranks``)."""
        super()._rendezvous(wg)

    def torch_assign(self, store: Any, rank: int, world: int, spec: WorkerSpec) -> list[Any]:
        """torch's own rank assignment for a membership settled without its round (a regroup)."""
        return super()._assign_worker_ranks(store, rank, world, spec)

    @property
    def watchdog(self) -> Any:
        return getattr(self, "_worker_watchdog", None)

    def torch_watchdogs(self, envs: dict[int, dict[str, str]]) -> None:
        """torchrun's worker watchdog and health-check server, which torch's own ``_start_workers``
        (replaced here) sets up: ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` starts a file-timer server
        per generation (watchdog.py: an expired timer SIGKILLs its worker, a ``Crash`` here, but
        not the agent as torch's does); ``TORCHELASTIC_HEALTH_CHECK_PORT`` starts torch's
        health-check server once, fed by that watchdog as under torchrun (a no-op stub in
        open-source torch)."""
        old = self.watchdog
        if old is not None:
            old.stop()
        self._worker_watchdog = start_watchdog(envs, self._worker_group.spec.rdzv_handler.get_run_id())
        if getattr(self, "_health_check_server", None) is None and hasattr(self, "_setup_healthcheck"):
            self._setup_healthcheck()

    def close(self) -> None:
        self.supervisor.close()  # the reaper first: the workers were stopped already
        for name in ("_worker_watchdog", "_health_check_server"):
            server = getattr(self, name, None)
            if server is not None:
                server.stop()
                setattr(self, name, None)
