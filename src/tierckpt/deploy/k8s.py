"""``tierckpt k8s render JOB.yaml``: a HyperPodPyTorchJob as manifests that run without the operator.

    tierckpt k8s render llama3_1_8b-fsdp-hpto.yaml [--target jobset|pytorchjob] [-o out.yaml]
        [--durable-url s3://bucket/ckpt] [--memory-budget 40%] [--peer-replicas 1] [--spares N]
        [--node-agent hosted|daemonset] [--secret-name NAME] | kubectl apply -f -

Call order: the CLI calls ``add_arguments(parser)`` once and ``main(args)``, which reads the
file, validates its ``runPolicy`` with the launcher's own parser (``launcher/jobspec.py``, so a
job the launcher would reject is never rendered), builds a ``RenderSpec`` and dumps the
ConfigMap (the job file), the Secret (peer replication) and the JobSet or PyTorchJob.

From the HyperPod job: ``metadata`` (name, namespace, labels such as Kueue's queue name),
``spec.nprocPerNode``, the one ``replicaSpecs`` entry (its ``replicas`` are the nodes, its
``spares`` the hot spares, its ``template`` the pod), ``spec.elasticPolicy``'s
``minReplicas``/``maxReplicas`` (``--nnodes MIN:MAX``), the trainer container's
``hyperpodrun``/``torchrun`` command (its torchrun options and script are kept, its rendezvous
options replaced), and ``runPolicy``. Spares are more pods of the same template running the
same ``tierckpt run``: whichever pods come last find the job on its maximum of nodes and wait
at the launcher's spare gate (docs/launcher.md "Hot spares").
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierckpt.deploy.k8s_manifests import RenderSpec, configmap, jobset, pytorchjob, secret
from tierckpt.errors import ConfigError, TierckptError

__all__ = ["K8sRenderError", "add_arguments", "build_spec", "main", "render"]

_LAUNCHERS = ("hyperpodrun", "torchrun", "tierckpt")
#: torchrun options (by argparse dest) that ``render`` sets itself: the rendezvous, the node count
_REPLACED = frozenset({"nnodes", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "standalone",
                       "node_rank", "master_addr", "master_port"})


class K8sRenderError(ConfigError):
    """The job file cannot be turned into manifests; the message names the field and the fix."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="k8s_command", required=True)
    r = sub.add_parser("render", help="HyperPodPyTorchJob YAML -> ConfigMap + Secret + JobSet or PyTorchJob")
    r.add_argument("job", help="a HyperPodPyTorchJob file (e.g. the seed's llama3_1_8b-fsdp-hpto.yaml)")
    r.add_argument("--target", choices=("jobset", "pytorchjob"), default="jobset",
                   help="the controller that runs the pods (JobSet: jobset.x-k8s.io; PyTorchJob: Kubeflow)")
    r.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    r.add_argument("--image", help="replace the trainer container's image")
    r.add_argument("--durable-url", help="durable tier for tierckpt run (s3://bucket/prefix or file:///fsx/...)")
    r.add_argument("--namespace-name", dest="ckpt_namespace", help="checkpoint namespace (default: the job name)")
    r.add_argument("--memory-dir", default="/dev/shm/tierckpt", help="memory tier on the node (a hostPath)")
    r.add_argument("--memory-budget", help="node-wide memory tier budget for the hosted agent (40%% or 64G)")
    r.add_argument("--peer-replicas", type=int, default=1, help="peer copies of each node's newest step (0: off)")
    r.add_argument("--spares", type=int, help="hot spare pods beyond the nodes, each waiting to take a lost "
                   "node's rank (default: spec.replicaSpecs[0].spares, else 0)")
    r.add_argument("--node-agent", choices=("hosted", "daemonset"), default="hosted",
                   help="hosted: tierckpt run hosts the agent in each pod; daemonset: deploy/k8s/base serves the node")
    r.add_argument("--secret-name", help="use this existing Secret (key 'secret') instead of rendering a new one")
    r.add_argument("--max-full-restarts", type=int,
                   help="controller restarts on exit 75 (default: runPolicy.restartPolicy.maxFullJobRestarts, else 3)")
    r.add_argument("--rdzv-port", type=int, default=29400)
    r.add_argument("--agent-port", type=int, default=7601)
    r.add_argument("--metrics-port", type=int, default=9400, help="tierckpt run's metrics")
    r.add_argument("--library-metrics-port", type=int, default=9410,
                   help="each worker's library metrics on this port + LOCAL_RANK")


def main(args: argparse.Namespace) -> int:
    try:
        text = render(Path(args.job), args)
    except TierckptError as exc:
        print(f"tierckpt k8s: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text, encoding="utf-8")
    return 0


def render(path: Path, args: argparse.Namespace) -> str:
    """The manifests for ``path`` as one multi-document YAML string."""
    import yaml

    job, elastic = _load(path)
    spec = build_spec(job, args, elastic=elastic)
    docs = [configmap(spec), secret(spec), jobset(spec) if args.target == "jobset" else pytorchjob(spec)]
    return yaml.safe_dump_all([d for d in docs if d is not None], sort_keys=False, width=120)


def _load(path: Path) -> tuple[dict[str, Any], tuple[int, int] | None]:
    """The job document and its ``elasticPolicy`` (MIN, MAX), as the launcher parses it."""
    from tierckpt.launcher.jobspec import JOB_KIND, load_job_file

    parsed = load_job_file(path)  # the launcher's own validation: a job it would reject is never rendered
    import yaml

    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    jobs = [d for d in docs if isinstance(d, Mapping) and d.get("kind") == JOB_KIND]
    if len(jobs) != 1:
        raise K8sRenderError(f"{path}: render needs a full {JOB_KIND} (apiVersion, kind, metadata, spec), "
                             "not a bare runPolicy", path=str(path))
    return dict(jobs[0]), parsed.elastic


def _launcher_options() -> dict[str, tuple[str, bool]]:
    """Every option string of ``tierckpt run`` (torchrun's and its own): (dest, takes a value)."""
    from tierckpt.launcher.cli import build_parser

    return {o: (a.dest, a.nargs != 0) for a in build_parser()._actions for o in a.option_strings}


def _fail(where: str, problem: str) -> K8sRenderError:
    return K8sRenderError(f"{where}: {problem}")


def build_spec(job: Mapping[str, Any], args: argparse.Namespace, *,
               elastic: tuple[int, int] | None = None) -> RenderSpec:
    """The RenderSpec of a parsed HyperPodPyTorchJob document (``elastic``: its ``elasticPolicy``
    as ``jobspec.load_job_file`` read it) and the CLI's options."""
    meta = job.get("metadata") or {}
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise _fail("metadata.name", "is required: it names the JobSet/PyTorchJob and the rendezvous id")
    spec = job.get("spec") or {}
    replica_specs = spec.get("replicaSpecs") or []
    if len(replica_specs) != 1:
        raise _fail("spec.replicaSpecs", f"has {len(replica_specs)} entries; render supports exactly one "
                    "(one pod per node, every pod the same)")
    rs = replica_specs[0]
    nodes = rs.get("replicas")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise _fail("spec.replicaSpecs[0].replicas", f"must be a whole number of nodes >= 1, got {nodes!r}")
    spares = args.spares if getattr(args, "spares", None) is not None else rs.get("spares", 0)
    if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
        raise _fail("spec.replicaSpecs[0].spares" if getattr(args, "spares", None) is None else "--spares",
                    f"must be a whole number of spare pods >= 0, got {spares!r}")
    template = rs.get("template") or {}
    containers = (template.get("spec") or {}).get("containers") or []
    if not containers:
        raise _fail("spec.replicaSpecs[0].template.spec.containers", "is empty; the first container is the trainer")
    trainer = containers[0]
    if args.image:
        trainer["image"] = args.image
    run_args = _run_args(trainer.get("command") or [], list(trainer.get("args") or []), spec, args, name)
    trainer.pop("args", None)
    run_policy = dict(spec.get("runPolicy") or {})
    restart = run_policy.get("restartPolicy") or {}
    max_full = args.max_full_restarts if args.max_full_restarts is not None else restart.get("maxFullJobRestarts", 3)
    return RenderSpec(
        name=name, namespace=meta.get("namespace"), labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}), nodes=nodes, spares=spares,
        nnodes=_nnodes(elastic, nodes), pod_template=template, run_args=run_args,
        run_policy=run_policy, max_full_restarts=int(max_full),
        secret_name=args.secret_name or f"{name}-tierckpt-agent",
        secret_value=None if args.secret_name else secrets.token_hex(32), memory_dir=args.memory_dir,
        rdzv_port=args.rdzv_port, agent_port=args.agent_port, metrics_port=args.metrics_port,
        library_metrics_port=args.library_metrics_port,
        hosted_agent=args.node_agent == "hosted" and args.peer_replicas > 0,
    )


def _nnodes(elastic: tuple[int, int] | None, nodes: int) -> str:
    """``tierckpt run --nnodes``: ``MIN:MAX`` of ``spec.elasticPolicy`` (the launcher would read it
    from a whole job file; the ConfigMap holds only the runPolicy), else the replicas."""
    if elastic is None:
        return str(nodes)
    lo, hi = elastic
    if not lo <= nodes <= hi:
        raise _fail("spec.replicaSpecs[0].replicas", f"{nodes} is outside elasticPolicy's {lo}..{hi}; "
                    "set replicas between minReplicas and maxReplicas")
    return f"{lo}:{hi}"


def _run_args(command: list[Any], extra: list[Any], spec: Mapping[str, Any], args: argparse.Namespace,
              name: str) -> list[str]:
    """tierckpt run's arguments from the trainer's launcher command (rendezvous options replaced)."""
    argv = [str(a) for a in command] + [str(a) for a in extra]
    where = "spec.replicaSpecs[0].template.spec.containers[0].command"
    if not argv or Path(argv[0]).name not in _LAUNCHERS:
        raise _fail(where, f"must start with one of {', '.join(_LAUNCHERS)} (got {argv[:1]}); "
                    "write the torchrun command line the job runs")
    argv = argv[2:] if Path(argv[0]).name == "tierckpt" and argv[1:2] == ["run"] else argv[1:]
    options = _launcher_options()
    kept: list[str] = []
    i, seen, script_seen = 0, set(), False
    while i < len(argv):
        a = argv[i]
        if script_seen or not a.startswith("-"):
            script_seen = True
            kept.append(a)
            i += 1
            continue
        opt = a.split("=", 1)[0]
        if opt not in options:
            raise _fail(where, f"{opt} is not a torchrun or tierckpt run option; remove it or put it after the script")
        dest, takes_value = options[opt]
        seen.add(dest)
        width = 2 if takes_value and "=" not in a else 1
        if dest not in _REPLACED:
            kept.extend(argv[i : i + width])
        i += width
    if not script_seen:
        raise _fail(where, "names no training script; end the command with the script and its arguments")
    ours = ["--namespace", args.ckpt_namespace or name]
    if "nproc_per_node" not in seen and spec.get("nprocPerNode") is not None:
        ours += ["--nproc-per-node", str(spec["nprocPerNode"])]
    if args.durable_url:
        ours += ["--durable-url", args.durable_url]
    if args.node_agent == "hosted" and args.peer_replicas > 0:
        ours += ["--replicas", str(args.peer_replicas)]
        if args.memory_budget:
            ours += ["--memory-budget", args.memory_budget]
    return ours + kept
