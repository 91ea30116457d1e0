"""``tierckpt run``: torchrun's own argument parser plus tierckpt's options; argv → agent → exit code.

    tierckpt run --nnodes 2 --nproc-per-node 1 --rdzv-endpoint host:29400 \\
        --rdzv-id job1 --max-restarts 5 --job job.yaml --namespace run1 --events ev.jsonl train.py ...

Every torchrun argument means what it means to torchrun. Exit codes: 0 the workers finished;
1 the job failed (restarts exhausted, CrashLoop, NoProgress, bad job file: 2); 75
(``FULL_RESTART_EXIT``) the job needs a full restart by the outer scheduler; 70
(``LAUNCHER_ERROR_EXIT``) the launcher itself failed (one line on stderr and in the ``exit``
event names the error; no traceback); 128 + N after signal N (the newest memory step was
persisted first).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import uuid
from argparse import ArgumentParser, Namespace
from collections.abc import Sequence
from typing import Any

from tierckpt import workerenv
from tierckpt.errors import ConfigError, TierckptError

__all__ = ["build_parser", "main"]

log = logging.getLogger("tierckpt.run")

_FAST_RDZV = {"keep_alive_interval": "1", "keep_alive_max_attempt": "3"}

#: ``--rdzv-backend`` when none is given (torchrun's is static): tierckpt's own (membership/rdzv.py)
RDZV_DEFAULT = "tierckpt"

#: restarts in all when neither --max-restarts nor runPolicy.jobMaxRetryCount is given
DEFAULT_MAX_RESTARTS = 10


def build_parser() -> ArgumentParser:
    from torch.distributed.run import get_args_parser

    p = get_args_parser()
    p.prog = "tierckpt run"
    # argparse reads every argument, the training script's too, as a possible abbreviation of an
    # option: with both --server-host and --server-port, a script's own --server failed as
    # "ambiguous" (and --name, once --namespace had a sibling). Options are spelled out in full.
    p.allow_abbrev = False
    p.description = ("A torchrun drop-in that detects crashes, hangs, non-finite losses, log-rule faults and lost "
                     "nodes, restarts every worker in place with a new job-wide generation, and escalates per the "
                     "HyperPod runPolicy. Exit codes: 0 done, 1 failed, 2 bad arguments or job file, "
                     "70 launcher error, 75 full job restart needed, 128+N signal N.")
    for action in p._actions:  # torchrun's own options, with tierckpt's defaults
        if action.dest == "rdzv_backend":
            action.default = RDZV_DEFAULT
            action.help = (f"rendezvous backend (default {RDZV_DEFAULT}: tierckpt's own, O(1) store operations per "
                           "node, launcher/membership/rdzv.py; c10d: torch's; static: torchrun's fixed ranks, with "
                           "--node-rank and --master-addr)")
        if action.dest == "max_restarts":  # None: not given
            action.default = None
            action.help = (f"restarts in all before the job fails (default {DEFAULT_MAX_RESTARTS}, torchrun's is 0: "
                           "a long job meets several faults, a lost node, a NaN, a preemption, and should recover "
                           "from each; a fault that repeats is stopped sooner by CrashLoop and NoProgress). "
                           "runPolicy.jobMaxRetryCount in --job overrides it; counted across full job restarts")
    g = p.add_argument_group("tierckpt")
    g.add_argument("--job", help="HyperPodPyTorchJob YAML (or just its runPolicy mapping): restart policy, log rules")
    g.add_argument("--namespace", help="exported to workers as TIERCKPT_NAMESPACE")
    g.add_argument("--memory-dir", default=os.environ.get("TIERCKPT_MEMORY_DIR") or None,
                   help="exported as TIERCKPT_MEMORY_DIR (default: that variable, else /dev/shm/tierckpt); restart "
                   "state is kept beside it")
    g.add_argument("--durable-url", help="exported as TIERCKPT_DURABLE_URL; the newest step is persisted there on exit")
    g.add_argument("--events", help="append events as JSON lines to this file")
    g.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (127.0.0.1; "
                   "TIERCKPT_METRICS_HOST to change)")
    g.add_argument("--heartbeat-timeout", default="auto",
                   help="'auto' (default: a silent rank is a hang when its process is stopped for 3 s, makes no "
                   "CPU progress for 5 s (more if such stalls were seen) while no other rank computes, or "
                   "passes --hang-ceiling; docs/launcher.md) or SECONDS (a fixed timeout, nothing else)")
    g.add_argument("--hang-ceiling", type=float, default=None,
                   help="seconds a rank may compute without a heartbeat (default: 10 x the longest interval "
                   "seen, at least 300 s)")
    g.add_argument("--node-timeout", type=float, default=10.0, help="an agent silent this long is a lost node")
    g.add_argument("--healthy-after-steps", type=int, default=None,
                   help="steps past its resumed step after which a generation counts as healthy: a fault after "
                   "that restarts at once and resets the backoff, as does a generation that ran 120 s (default "
                   "10; 0: only the 120 s count). Crash loops (no first beat, or fewer steps) still back off")
    g.add_argument("--stop-grace", type=float, default=0.0,
                   help="SIGTERM grace (s) before SIGKILL when a fault stops workers (default: SIGKILL at once)")
    g.add_argument("--warm-workers", default="auto",
                   help="standby interpreters per agent, torch imported ahead, that become the workers of a "
                   "(re)start: 'auto' (one per local worker), N, or 0 (off; also --no-warm); as many again are "
                   "kept as spares (importing at idle priority) so a fault right after a restart is warm too")
    g.add_argument("--no-warm", action="store_true", help="every worker start is cold (same as --warm-workers 0)")
    g.add_argument("--warm-imports", default="",
                   help="comma-separated modules the standbys import ahead beside torch (e.g. the script's models)")
    g.add_argument("--warm-loader", action="append", default=[], metavar="MODULE:FUNCTION",
                   help="a data loader factory, FUNCTION(rank, world_size) -> tierckpt.data.ResumableLoader, that "
                        "each standby calls (rank and world_size None, sys.argv the script's) and starts ahead: "
                        "after a restart the script's tierckpt.data.ahead(FUNCTION) takes its loader, workers "
                        "forked and warm (repeatable; docs/data.md)")
    g.add_argument("--avoid-file", default=os.environ.get("TIERCKPT_AVOID_FILE") or None,
                   help="at a full job restart, write the machines the next start should avoid (repeat "
                        "offenders), one a line, for the scheduler (default $TIERCKPT_AVOID_FILE)")
    g.add_argument("--avoid-wait", type=float, default=120.0,
                   help="seconds a relaunched repeat offender leaves the first round's seats to other nodes "
                        "before it takes a free one (default 120)")
    _health_arguments(p)
    h = p.add_argument_group("hyperpodrun (the HyperPod elastic agent's own options, accepted as it spells them)")
    h.add_argument("--server-host", "--server_host", default="127.0.0.1",
                   help="address of the agent's HTTP API (default 127.0.0.1; hyperpodrun's is 0.0.0.0)")
    h.add_argument("--server-port", "--server_port", type=int, default=None,
                   help="serve the agent's HTTP API on this port: GET /health, /status (JSON: state, generation, "
                   "restart count), /restart_count (default: no API; 0 picks a free port)")
    h.add_argument("--server-log-level", "--server_log_level", default="info",
                   help="accepted for hyperpodrun's command lines; the API logs nothing")
    h.add_argument("--server-shutdown-timeout", "--server_shutdown_timeout", type=float, default=None,
                   help="accepted for hyperpodrun's command lines; the API stops at once with the agent")
    h.add_argument("--shutdown-signal", "--shutdown_signal", choices=("SIGTERM", "SIGKILL"), default=None,
                   help="how a fault stops the workers: SIGKILL at once (the default), or SIGTERM and SIGKILL "
                   "after --shutdown-timeout seconds (default 15, as hyperpodrun); the same as --stop-grace")
    h.add_argument("--pre-train-script", "--pre_train_script", default=None,
                   help="run this script on every node before its workers start, at every (re)start (a .py "
                   "file runs under this Python; else it is executed)")
    h.add_argument("--pre-train-args", "--pre_train_args", default="", help="its arguments, one string (shlex)")
    h.add_argument("--post-train-script", "--post_train_script", default=None,
                   help="run this script on every node once its workers all succeeded")
    h.add_argument("--post-train-args", "--post_train_args", default="", help="its arguments, one string (shlex)")
    h.add_argument("--inprocess-restart", "--inprocess_restart", action="store_true",
                   help="accepted: workers under tierckpt.resilient restart in-process with or without it "
                   "(docs/launcher.md, In-process restarts)")
    h.add_argument("--inprocess-timeout", "--inprocess_timeout", type=float, default=None,
                   help="accepted for hyperpodrun's command lines; tierckpt.resilient's own timeouts apply")
    h.add_argument("--checkpointing-log-dir", default=os.environ.get("TIERCKPT_CHECKPOINTING_LOG_DIR") or None,
                   help="write this agent's log records to DIR/<namespace>_checkpointing.log, as the seed's "
                   "library writes /var/log/sagemaker_checkpointing/<namespace>_checkpointing.log (default "
                   "$TIERCKPT_CHECKPOINTING_LOG_DIR, else no file)")
    a = p.add_argument_group("tierckpt node agent (hosted for this node when one of these is given, or by "
                             "default on several nodes without --durable-url, unless an agent already serves the "
                             "memory root)")
    a.add_argument("--replicas", type=int,
                   help="peer copies of this node's newest memory step (tierckpt agent). Default: 1 when --nnodes "
                   "is more than 1 and there is no --durable-url (a lost node's steps survive on a peer; a global "
                   "checkpoint stays loadable), else none. 0 opts out: a lost node then loses the steps only its "
                   "memory tier held")
    a.add_argument("--peers", help="the other nodes' agents, host:port,host:port")
    a.add_argument("--agent-listen", default=None, help="HOST:PORT the hosted agent listens on for peers "
                   "(default 127.0.0.1:0 on one host; with --rdzv-endpoint on another host, every interface with "
                   "the job's secret, or one generated per job; anything but loopback needs a secret)")
    a.add_argument("--memory-budget", help="node-wide memory tier budget: 40%% of RAM (20-100%%) or bytes (64G)")
    a.add_argument("--agent-secret-file", help="the job's secret for peer connections (else $TIERCKPT_AGENT_SECRET)")
    a.add_argument("--agent-insecure-wire", action="store_true",
                   help="peer replication without TLS (for a fabric you trust: no encryption, integrity only from "
                        "the item checksums; the handshake still authenticates peers); every node of the job must "
                        "agree; off by default, a warning and the tierckpt_agent_insecure_wire gauge when on")
    return p


def _health_arguments(p: ArgumentParser) -> None:
    """The node health monitor's options (launcher/detect/health.py; docs/launcher.md "Node health")."""
    g = p.add_argument_group("node health (an unhealthy node leaves for a waiting spare at a step boundary)")
    g.add_argument("--health-check", action="append", default=[], metavar="CMD",
                   help="a shell command run on this node every --health-interval; a non-zero exit (or no answer "
                   "within 30 s) fails it (repeatable; e.g. a site's node check, a script around 'dcgmi health -c')")
    g.add_argument("--health-checks", default="auto",
                   help="built-in checks, comma-separated from nic,edac,memfs,gpu, or 'none' (default 'auto': "
                   "each where it applies: the rendezvous/gloo interface, EDAC where the kernel has it, the "
                   "memory tier's filesystem, nvidia-smi where it is on PATH)")
    g.add_argument("--health-interval", type=float, default=10.0, help="seconds between health rounds (default 10)")
    g.add_argument("--health-fail-after", type=int, default=2,
                   help="failing rounds in a row before the node counts as unhealthy (default 2)")
    g.add_argument("--health-drain-wait", type=float, default=120.0,
                   help="seconds an unhealthy node with a spare waiting waits for the next committed step before "
                   "it leaves anyway (default 120)")
    g.add_argument("--health-nic", action="append", default=[], metavar="IFACE",
                   help="network interface(s) the nic check watches (repeatable; default $GLOO_SOCKET_IFNAME, "
                   "else the one that routes to the rendezvous endpoint)")
    g.add_argument("--no-health", action="store_true", help="no health checks at all (commands included)")


def _health(args: Namespace) -> Any:
    """The health monitor's config; the checks are built once here so that a bad command fails
    before any worker starts (exit 2)."""
    from tierckpt.launcher.detect.health import HealthConfig, build_checks, route_interface

    names = [c.strip() for c in str(args.health_checks).split(",") if c.strip()]
    checks = None if names == ["auto"] else () if names == ["none"] else tuple(names)
    nics = tuple(args.health_nic)
    if not nics and not args.no_health:
        gloo = os.environ.get("GLOO_SOCKET_IFNAME", "")
        nics = tuple(n for n in gloo.split(",") if n)
        if not nics and args.rdzv_endpoint and not args.standalone:
            host = args.rdzv_endpoint.rpartition(":")[0].strip("[]") or args.rdzv_endpoint
            found = route_interface(host)
            nics = (found,) if found else ()
    cfg = HealthConfig(enabled=not args.no_health, checks=checks, commands=tuple(args.health_check),
                       interval_s=args.health_interval, fail_after=args.health_fail_after,
                       drain_wait_s=args.health_drain_wait, nics=nics, memory_dir=args.memory_dir or _default_memory_dir())
    build_checks(cfg)  # a ConfigError (exit 2) for a command that cannot run
    return cfg


def _default_memory_dir() -> str:
    from tierckpt.config import DEFAULT_MEMORY_DIR

    return DEFAULT_MEMORY_DIR


def _agent_config(args: Namespace) -> Any:
    """The hosted node agent's config, or None when none is hosted.

    Several nodes with no durable tier replicate by default (``--replicas 1``): otherwise a
    lost node takes with it the only copy of its ranks' files, and a global checkpoint cannot
    be loaded by anyone. ``--replicas 0`` opts out, with a one-line warning.
    """
    replicas = args.replicas
    if replicas is None and _max_nodes(args.nnodes) > 1 and not args.durable_url:
        replicas = 1  # the safe default (--help says so)
    if replicas == 0 and args.peers is None and args.memory_budget is None:
        if _max_nodes(args.nnodes) > 1 and not args.durable_url:
            print(f"tierckpt run: warning: --replicas 0 and no --durable-url on {args.nnodes} nodes: a lost node "
                  "loses the steps only its memory tier held", file=sys.stderr)
        return None
    if replicas is None and args.peers is None and args.memory_budget is None:
        return None
    from tierckpt.agent.config import AgentConfig, node_ram_bytes, parse_address, parse_budget, read_secret
    from tierckpt.config import DEFAULT_MEMORY_DIR

    if args.memory_dir is None and (args.replicas is not None or args.peers is not None
                                    or args.memory_budget is not None):
        raise TierckptError("--replicas/--peers/--memory-budget need --memory-dir (the node's memory tier)")
    peers = tuple(parse_address(x) for x in (args.peers or "").split(",") if x.strip())
    # by default the workers' memory tier is the library's default root: serve that one
    return AgentConfig(memory_dir=args.memory_dir or DEFAULT_MEMORY_DIR, listen=parse_address(args.agent_listen or "127.0.0.1:0"),
                       peers=peers, replicas=1 if replicas is None else replicas,
                       secret=read_secret(args.agent_secret_file), insecure_wire=args.agent_insecure_wire,
                       budget_bytes=None if args.memory_budget is None else parse_budget(args.memory_budget,
                                                                                       node_ram_bytes()),
                       durable_url=args.durable_url)


def _agent_across_hosts(args: Namespace, agent: Any) -> bool:
    """The hosted agent's peers are other hosts and nothing says where it listens: then it listens
    on every interface (``dataplane.host.hosted_agent_config``) instead of loopback, with the job's own
    secret when one was given, else a secret generated per job. A secret alone used to leave it
    on loopback, publishing 127.0.0.1 to peers on other hosts."""
    if args.agent_listen is not None or _max_nodes(args.nnodes) < 2:
        return False
    host = (args.rdzv_endpoint or "").rpartition(":")[0].strip("[]") if ":" in (args.rdzv_endpoint or "") \
        else (args.rdzv_endpoint or "")
    return not _loopback_name(host)


def _loopback_name(host: str) -> bool:
    if host in ("", "localhost", "::1") or host.startswith("127."):
        return True
    try:
        import ipaddress

        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _job_nnodes(nnodes: str, elastic: tuple[int, int] | None) -> str:
    """``--nnodes`` after the job file's ``elasticPolicy`` (minReplicas:maxReplicas): it applies
    when ``--nnodes`` was not given (torchrun's default ``1:1``); both given and different is an error."""
    if elastic is None:
        return nnodes
    wanted = f"{elastic[0]}:{elastic[1]}"
    given = str(nnodes)
    lo, _, hi = given.partition(":")
    if given in ("1:1", wanted) or (lo, hi or lo) == (str(elastic[0]), str(elastic[1])):
        return wanted
    raise TierckptError(f"--nnodes {given} and the job file's elasticPolicy ({wanted}) disagree; "
                        "drop one of them")


def _max_nodes(nnodes: str) -> int:
    """The most nodes torchrun's ``--nnodes`` (N or MIN:MAX) admits; 1 when it does not parse (torch reports it)."""
    try:
        return int(str(nnodes).rsplit(":", 1)[-1])
    except ValueError:
        return 1


def _options(args: Namespace) -> Any:
    from tierckpt.launcher.agentapi import ApiSettings
    from tierckpt.launcher.decide.escalation import EscalationPolicy
    from tierckpt.launcher.detect.heartbeat import HeartbeatPolicy
    from tierckpt.launcher.jobspec import RunPolicy, load_job_file
    from tierckpt.launcher.membership.avoid import AvoidSettings
    from tierckpt.launcher.membership.change import Elastic
    from tierckpt.launcher.options import RunOptions
    from tierckpt.launcher.workers.hooks import TrainScripts

    policy = RunPolicy()
    allowed: tuple[int, ...] = ()
    scale_down_wait_s = 0.0
    if args.job:
        job = load_job_file(args.job)
        policy = job.run_policy
        ep = job.elastic_policy
        allowed = ep.allowed if ep is not None else ()
        if ep is not None:
            _elastic_timeouts(args, ep)
            scale_down_wait_s = float(ep.faulty_scale_down_timeout_s or 0.0)
        if job.ignored_fields:
            log.warning("tierckpt run: job file fields not used by the launcher: %s", ", ".join(job.ignored_fields))
        args.nnodes = _job_nnodes(args.nnodes, job.elastic)
    agent = _agent_config(args)
    if args.heartbeat_timeout == "auto":
        fixed = None
    else:
        try:
            fixed = float(args.heartbeat_timeout)
        except ValueError:
            raise TierckptError(f"--heartbeat-timeout must be 'auto' or seconds, got {args.heartbeat_timeout!r}") from None
        if not math.isfinite(fixed) or fixed <= 0:
            raise TierckptError(f"--heartbeat-timeout must be positive, got {args.heartbeat_timeout!r}")
    overrides: dict[str, Any] = {}
    if args.healthy_after_steps is not None:
        if args.healthy_after_steps < 0:
            raise TierckptError(f"--healthy-after-steps must be 0 or more, got {args.healthy_after_steps}")
        overrides["healthy_after_steps"] = args.healthy_after_steps
    if policy.job_max_retry_count is not None:
        overrides["job_max_retry_source"] = f"runPolicy.jobMaxRetryCount {policy.job_max_retry_count}"
    elif args.max_restarts is not None:
        overrides.update(job_max_retry_count=args.max_restarts, job_max_retry_source=f"--max-restarts {args.max_restarts}")
    else:
        overrides.update(job_max_retry_count=DEFAULT_MAX_RESTARTS,
                         job_max_retry_source=f"--max-restarts (default {DEFAULT_MAX_RESTARTS})")
    return RunOptions(
        namespace=args.namespace, memory_dir=args.memory_dir, durable_url=args.durable_url,
        events_path=args.events, metrics_port=args.metrics_port,
        heartbeat=HeartbeatPolicy(fixed_timeout_s=fixed, startup_deadline_s=policy.startup_deadline_s,
                                  hang=_hang_policy(args)),
        run_policy=policy, escalation=EscalationPolicy.from_run_policy(policy, **overrides),
        node_timeout_s=args.node_timeout, stop_grace_s=_stop_grace(args), agent=agent,
        agent_across_hosts=agent is not None and _agent_across_hosts(args, agent),
        warm=_warm_policy(args), rdzv_endpoint=args.rdzv_endpoint or "", elastic=Elastic.parse(args.nnodes, allowed, scale_down_wait_s),
        avoid=AvoidSettings(file=args.avoid_file, wait_s=args.avoid_wait, machine=os.environ.get("TIERCKPT_NODE_NAME", "")),
        api=ApiSettings(host=args.server_host, port=args.server_port),
        scripts=TrainScripts.from_args(pre=args.pre_train_script, pre_args=args.pre_train_args,
                                       post=args.post_train_script, post_args=args.post_train_args),
        log_dir=_checkpointing_log_dir(args), health=_health(args),
    )


#: hyperpodrun's --shutdown-timeout default (torchrun's own option, which tierckpt run's agent uses too)
HYPERPOD_SHUTDOWN_TIMEOUT_S = 15.0


def _elastic_timeouts(args: Namespace, ep: Any) -> None:
    """The job file's ``elasticPolicy`` timeouts where the command line set nothing:
    ``scalingTimeoutInSeconds`` is how long a round with MIN nodes waits for more (the rendezvous'
    ``last_call_timeout``, both backends); ``gracefulShutdownTimeoutInSeconds`` is the workers'
    SIGTERM grace when they are stopped (``--stop-grace``). ``faultyScaleDownTimeoutInSeconds`` is
    ``Elastic.scale_down_wait_s`` (rounds.regroup)."""
    given = {kv.split("=", 1)[0].strip() for kv in (args.rdzv_conf or "").split(",") if "=" in kv}
    if ep.scaling_timeout_s is not None and "last_call_timeout" not in given:
        args.rdzv_conf = ",".join(x for x in [args.rdzv_conf, f"last_call_timeout={ep.scaling_timeout_s:g}"] if x)
    if ep.graceful_shutdown_timeout_s is not None and not args.stop_grace and args.shutdown_signal is None:
        args.stop_grace = float(ep.graceful_shutdown_timeout_s)


def _stop_grace(args: Namespace) -> float:
    """Seconds between SIGTERM and SIGKILL when a fault stops workers: ``--stop-grace``, or
    hyperpodrun's ``--shutdown-signal SIGTERM`` with ``--shutdown-timeout`` (default 15 s); 0: SIGKILL."""
    grace = args.stop_grace
    if not (math.isfinite(grace) and grace >= 0):
        raise TierckptError(f"--stop-grace must be 0 or more seconds, got {grace:g}")
    if args.shutdown_signal is None:
        return float(grace)
    wanted = 0.0 if args.shutdown_signal == "SIGKILL" else float(
        HYPERPOD_SHUTDOWN_TIMEOUT_S if args.shutdown_timeout is None else args.shutdown_timeout)
    if wanted <= 0 and args.shutdown_signal == "SIGTERM":
        raise TierckptError(f"--shutdown-signal SIGTERM needs a --shutdown-timeout above 0, got {wanted:g}")
    if grace and grace != wanted:
        raise TierckptError(f"--stop-grace {grace:g} and --shutdown-signal {args.shutdown_signal} (a grace of "
                            f"{wanted:g} s) disagree; give one of them")
    return wanted


def _checkpointing_log_dir(args: Namespace) -> str | None:
    d = args.checkpointing_log_dir
    if d is None:
        return None
    if not args.namespace:
        raise TierckptError("--checkpointing-log-dir names its file after the namespace; give --namespace too")
    from tierckpt.launcher import preflight

    preflight.check_writable_dir("--checkpointing-log-dir", d)
    return str(d)


def _hang_policy(args: Namespace) -> Any:
    from tierckpt.launcher.detect.hang import HangPolicy

    ceiling = args.hang_ceiling
    if ceiling is not None and not (math.isfinite(ceiling) and ceiling > 0):
        raise TierckptError(f"--hang-ceiling must be positive seconds, got {ceiling:g}")
    return HangPolicy(ceiling_s=ceiling)


def _warm_policy(args: Namespace) -> Any:
    from tierckpt.launcher.workers.warm import WarmPolicy

    imports = tuple(m.strip() for m in args.warm_imports.split(",") if m.strip())
    for name in imports:
        if not all(part.isidentifier() for part in name.split(".")):
            raise TierckptError(f"--warm-imports: {name!r} is not a module name (a.b.c, comma-separated)")
    loaders = tuple(args.warm_loader)
    for spec in loaders:
        if workerenv.split_loader_spec(spec) is None:
            raise ConfigError(f"--warm-loader wants MODULE:FUNCTION (e.g. train:make_loader), got {spec!r}")
    if args.no_warm:
        return WarmPolicy(workers=0, imports=imports)
    if args.warm_workers == "auto":
        n = _local_workers(args.nproc_per_node)
        return WarmPolicy(workers=n, spare=n, imports=imports, loaders=loaders)
    try:
        n = int(args.warm_workers)
    except ValueError:
        raise TierckptError(f"--warm-workers must be 'auto' or a count, got {args.warm_workers!r}") from None
    if n < 0:
        raise TierckptError(f"--warm-workers must be 0 or more, got {n}")
    return WarmPolicy(workers=n, spare=n, imports=imports, loaders=loaders)


def _local_workers(nproc: str) -> int:
    """torchrun's --nproc-per-node as a count ('gpu', 'auto', 'cpu': as torchrun resolves them)."""
    try:
        return max(1, int(nproc))
    except ValueError:
        from torch.distributed.run import determine_local_world_size

        try:
            return max(1, int(determine_local_world_size(nproc)))
        except ValueError:  # torchrun reports it when the job starts
            return 1


def _validate(args: Namespace) -> None:
    from tierckpt.config import DurableLocation, validate_namespace
    from tierckpt.launcher import preflight

    if args.namespace is not None:
        validate_namespace(args.namespace)
    if args.durable_url is not None:
        DurableLocation.parse(args.durable_url)
    if args.memory_dir is not None:
        if not os.path.isabs(args.memory_dir):
            raise TierckptError(f"--memory-dir must be an absolute path, got {args.memory_dir!r}")
        preflight.check_writable_dir("--memory-dir", args.memory_dir)
    if args.events is not None:
        preflight.check_writable_file("--events", args.events)
    if args.server_port is not None:
        preflight.check_port("--server-port", args.server_host, args.server_port)
    if not args.standalone and args.rdzv_endpoint:
        preflight.check_endpoint(args.rdzv_endpoint)
    preflight.check_script(args.training_script, module=args.module, no_python=args.no_python)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        _validate(args)
        opts = _options(args)
    except TierckptError as exc:
        print(f"tierckpt run: error: {exc}", file=sys.stderr)
        return 2
    return launch(args, opts)


def launch(args: Namespace, opts: Any) -> int:
    import faulthandler
    import signal

    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry
    from torch.distributed.launcher.api import _get_addr_and_port
    from torch.distributed.run import config_from_args

    from tierckpt.launcher.events import describe_error
    from tierckpt.launcher.options import FULL_RESTART_EXIT, LAUNCHER_ERROR_EXIT
    from tierckpt.launcher.supervisor.torch_agent import TierckptAgent
    from tierckpt.launcher.workers.reaper import Reaper

    # ``kill -USR2 <launcher>`` writes every thread's stack to its stderr (a launcher that seems stuck)
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    if args.standalone:  # one host: a store of its own on a free port (torchrun's --standalone, our backend)
        args.rdzv_backend = args.rdzv_backend if args.rdzv_backend in ("c10d", RDZV_DEFAULT) else RDZV_DEFAULT
        args.rdzv_endpoint, args.rdzv_id = "localhost:0", str(uuid.uuid4())
    elif args.rdzv_backend in ("static", RDZV_DEFAULT) and not args.rdzv_endpoint and args.master_port is None:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = RDZV_DEFAULT, "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    if args.max_restarts is None:
        args.max_restarts = DEFAULT_MAX_RESTARTS
    if args.tee == "0" and args.redirects == "0":
        args.tee = "3"  # worker output to the console with rank prefixes, and to files for the log rules
    if args.rdzv_backend == "c10d":
        given = {kv.split("=", 1)[0] for kv in args.rdzv_conf.split(",") if "=" in kv}
        extra = [f"{k}={v}" for k, v in _FAST_RDZV.items() if k not in given]
        args.rdzv_conf = ",".join(x for x in [args.rdzv_conf, *extra] if x)
    config, cmd, cmd_args = config_from_args(args)
    params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
                                  min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                  local_addr=config.local_addr, **config.rdzv_configs)
    master_addr, master_port = _get_addr_and_port(params)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    # workers meet on a fresh store per generation (supervisor/torch_agent.py), never on the agents' store; and
    # with the shared store a rank-0 survivor never republishes MASTER_ADDR for a new round, so
    # a replacement node would wait forever in its first rendezvous
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # forked before torch's rendezvous handler starts its store threads; stops the workers if
    # this process dies (reaper.py)
    reaper = Reaper.fork()
    from tierckpt.launcher.membership.rdzv import register as register_tierckpt_rdzv

    register_tierckpt_rdzv()  # --rdzv-backend tierckpt (membership/rdzv.py)
    try:
        rdzv_handler = rdzv_registry.get_rendezvous_handler(params)
    except BaseException:
        reaper.close()
        raise
    spec = WorkerSpec(role=config.role, local_world_size=config.nproc_per_node, entrypoint=cmd, args=tuple(cmd_args),
                      rdzv_handler=rdzv_handler, max_restarts=config.max_restarts,
                      monitor_interval=config.monitor_interval, master_addr=master_addr, master_port=master_port,
                      local_addr=config.local_addr, duplicate_stdout_filters=config.duplicate_stdout_filters,
                      duplicate_stderr_filters=config.duplicate_stderr_filters, numa_options=config.numa_options)
    if config.logs_specs is None:  # torch's config_from_args always sets it; a changed torch would not
        reaper.close()
        raise ConfigError("torch's launcher config came without logs_specs (an unsupported torch version?)")
    agent = TierckptAgent(spec, config.logs_specs, opts, start_method=config.start_method,
                          log_line_prefix_template=config.log_line_prefix_template,
                          shutdown_timeout=int(config.shutdown_timeout or 30), reaper=reaper)
    shutdown_rdzv = True
    try:
        result = agent.run()
        if agent.failure is not None:  # the loop failed; its exit event says so too
            print(f"tierckpt run: error: {agent.failure} (exit {agent.exit_code})", file=sys.stderr)
        if result is None:  # torch's run() after the rendezvous closed gracefully: nothing ran
            return 0
        if result.is_failed():
            shutdown_rdzv = agent.exit_code != FULL_RESTART_EXIT
            return agent.exit_code or 1
        return 0
    except SignalException as exc:
        shutdown_rdzv = False  # the rendezvous stays open for the agents that come back
        return agent.exit_code or 128 + int(exc.sigval)
    except Exception as exc:  # outside the loop (which reports its own): one line, no traceback
        print(f"tierckpt run: error: {describe_error(exc)} (exit {LAUNCHER_ERROR_EXIT})", file=sys.stderr)
        return LAUNCHER_ERROR_EXIT
    finally:
        agent.close()
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
