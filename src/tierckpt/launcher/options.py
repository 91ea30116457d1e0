"""The launcher's own settings beside torchrun's: one frozen value built at the command line's edge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierckpt.launcher.agentapi import ApiSettings
from tierckpt.launcher.decide.escalation import EscalationPolicy
from tierckpt.launcher.detect.health import HealthConfig
from tierckpt.launcher.detect.heartbeat import HeartbeatPolicy
from tierckpt.launcher.jobspec import RunPolicy
from tierckpt.launcher.membership.avoid import AvoidSettings
from tierckpt.launcher.membership.change import Elastic
from tierckpt.launcher.workers.hooks import TrainScripts
from tierckpt.launcher.workers.warm import WarmPolicy

__all__ = ["FULL_RESTART_EXIT", "LAUNCHER_ERROR_EXIT", "RunOptions"]

#: exit code of every agent when the job needs a full restart (EX_TEMPFAIL): the outer
#: scheduler (Kubernetes Job/JobSet restart policy, Slurm --requeue, systemd) recreates them
FULL_RESTART_EXIT = 75
#: exit code of an agent whose own loop failed on an error it does not handle (EX_SOFTWARE): the
#: workers were stopped and the newest memory step persisted; the ``exit`` event's ``why`` and one
#: line on stderr name the error and where it was raised
LAUNCHER_ERROR_EXIT = 70


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """What ``tierckpt run`` adds to torchrun.

    namespace / memory_dir / durable_url   exported to workers as TIERCKPT_* (and used to
                                           persist the newest memory step on the way out)
    events_path                            JSON-lines events file (None: none)
    metrics_port                           Prometheus endpoint port (None: none; 0: any)
    heartbeat                              hang and startup detection
    run_policy                             HyperPod runPolicy (log rules, deadlines)
    escalation                             restart decisions
    node_timeout_s                         an agent silent this long is a lost node
    stop_grace_s                           SIGTERM grace before SIGKILL when a fault stops workers
    agent                                  a node agent to host (None: none, or one runs already)
    agent_across_hosts                     the hosted agent listens on every interface with a per-job
                                           secret handed out through the rendezvous store (the nodes
                                           are other hosts and neither --agent-listen nor a secret
                                           was given); it starts after the first rendezvous
    rdzv_endpoint                          HOST:PORT named in rendezvous progress lines ('' unknown)
    warm                                   standby interpreters for warm (re)starts (0: off)
    elastic                                --nnodes MIN:MAX (or the job's elasticPolicy): a lost node
                                           with MIN survivors regroups without a rendezvous round
    avoid                                  --avoid-file, --avoid-wait, $TIERCKPT_NODE_NAME: repeat
                                           offenders at full job restarts (avoid.AvoidSettings)
    api                                    --server-host/--server-port: the agent's HTTP API (agentapi.py)
    scripts                                --pre-train-script/--post-train-script (workers/hooks.py)
    log_dir                                --checkpointing-log-dir: <dir>/<namespace>_checkpointing.log gets the
                                           agent's log records (None: no file)
    health                                 the node health monitor: --health-check, --health-checks,
                                           --health-interval, --no-health ... (detect/health.HealthConfig);
                                           an unhealthy node leaves for a waiting spare (supervisor/draining.py)
    """

    namespace: str | None = None
    memory_dir: str | None = None
    durable_url: str | None = None
    events_path: str | None = None
    metrics_port: int | None = None
    heartbeat: HeartbeatPolicy = field(default_factory=HeartbeatPolicy)
    run_policy: RunPolicy = field(default_factory=RunPolicy)
    escalation: EscalationPolicy = field(default_factory=EscalationPolicy)
    node_timeout_s: float = 10.0
    stop_grace_s: float = 0.0
    liveness_interval_s: float = 0.5
    warm: WarmPolicy = field(default_factory=WarmPolicy)
    agent: Any = None  # tierckpt.agent.AgentConfig: host a node agent (replication, budget, flush)
    agent_across_hosts: bool = False
    rdzv_endpoint: str = ""
    elastic: Elastic | None = None
    avoid: AvoidSettings = field(default_factory=AvoidSettings)  # repeat offenders at full restarts (avoid.py)
    api: ApiSettings = field(default_factory=ApiSettings)
    scripts: TrainScripts = field(default_factory=TrainScripts)
    log_dir: str | None = None
    health: HealthConfig = field(default_factory=HealthConfig)
