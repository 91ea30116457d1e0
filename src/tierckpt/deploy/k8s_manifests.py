"""Kubernetes objects for one training job: ConfigMap, Secret, and a JobSet or a PyTorchJob.

Pure functions from a ``RenderSpec`` (what ``tierckpt k8s render`` read from the HyperPod job and
its options) to plain dicts, dumped as YAML by the caller. The exit-code contract of
``tierckpt run`` (docs/launcher.md) is wired to each controller:

- JobSet: each child Job's ``podFailurePolicy`` turns exit code 75 into a Job failure with
  reason ``PodFailurePolicy``, which the JobSet ``failurePolicy`` answers with ``RestartJobSet``
  (every pod recreated: the full job restart), at most ``maxFullJobRestarts`` times; any other
  failure exhausts ``backoffLimit: 0`` (``BackoffLimitExceeded``) and fails the JobSet. A pod
  that dies with its node or by preemption (``DisruptionTarget``) is recreated without counting.
- PyTorchJob: ``restartPolicy: ExitCode`` treats 1-127 as permanent and 128-255 as retryable,
  so the container's shell maps 75 to 175 (and forwards SIGTERM so the launcher can persist).

Repeat offenders at a full job restart (docs/deploy.md "Kubernetes"): every pod requires a node
without the label ``tierckpt.io/avoid=<job name>`` (``nodeAffinity``, ANDed into each of the
template's own required terms), and knows its node by name (``TIERCKPT_NODE_NAME`` from the
downward API's ``spec.nodeName``), so the launcher's ``offender`` event names the node to label
and a recreated pod that lands on an avoided node anyway is kept from its rank (launcher/membership/avoid.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

__all__ = ["AVOID_LABEL", "EXIT_FULL_RESTART", "RenderSpec", "avoid_nodes", "configmap", "jobset", "pytorchjob",
           "secret"]

EXIT_FULL_RESTART = 75
#: a node labelled ``tierckpt.io/avoid=<job name>`` gets no pod of that job (``avoid_nodes``)
AVOID_LABEL = "tierckpt.io/avoid"
#: Kubeflow's ExitCode policy retries 128-255 only; 75 + 100 lands there and reads back easily
PYTORCHJOB_RETRY_CODE = 175
JOB_FILE_DIR = "/etc/tierckpt/job"
SECRET_DIR = "/etc/tierckpt/secret"

# The container shell for PyTorchJob: tierckpt run as a child, SIGTERM forwarded, 75 -> 175.
RETRY_WRAPPER = (
    'trap \'kill -TERM "$pid" 2>/dev/null\' TERM INT\n'
    'tierckpt run "$@" & pid=$!\n'
    'while :; do wait "$pid"; rc=$?; kill -0 "$pid" 2>/dev/null || break; done\n'
    f'if [ "$rc" -eq {EXIT_FULL_RESTART} ]; then rc={PYTORCHJOB_RETRY_CODE}; fi\n'
    'exit "$rc"\n'
)


@dataclass(frozen=True, kw_only=True)
class RenderSpec:
    """Everything the manifests need; built by ``tierckpt.deploy.k8s`` from the job file."""

    name: str
    namespace: str | None
    labels: dict[str, str]
    annotations: dict[str, str]
    nodes: int  # the replicas: nodes the job runs on at its start
    spares: int  # more pods of the same template: they wait at tierckpt run's spare gate
    nnodes: str  # tierckpt run --nnodes: the replicas, or MIN:MAX of an elasticPolicy
    pod_template: dict[str, Any]  # the HyperPod replica's PodTemplateSpec, trainer container first
    run_args: list[str]  # tierckpt run arguments after "tierckpt run", rendezvous excluded
    run_policy: dict[str, Any]  # the HyperPod runPolicy, for the ConfigMap
    max_full_restarts: int
    secret_name: str
    secret_value: str | None  # None: the Secret exists already, do not render it
    memory_dir: str
    rdzv_port: int
    agent_port: int
    metrics_port: int
    library_metrics_port: int
    hosted_agent: bool

    @property
    def pods(self) -> int:
        """Every pod: the nodes and the spares, all the same."""
        return self.nodes + self.spares

    @property
    def configmap_name(self) -> str:
        return f"{self.name}-tierckpt-job"


def _meta(spec: RenderSpec, name: str, *, job: bool = False) -> dict[str, Any]:
    """Metadata; the job object keeps the HyperPod job's labels (e.g. Kueue's queue) and annotations."""
    labels = {**(spec.labels if job else {}), "app.kubernetes.io/managed-by": "tierckpt",
              "app.kubernetes.io/instance": spec.name}
    meta: dict[str, Any] = {"name": name, "labels": labels}
    if spec.namespace:
        meta["namespace"] = spec.namespace
    if job and spec.annotations:
        meta["annotations"] = dict(spec.annotations)
    return meta


def configmap(spec: RenderSpec) -> dict[str, Any]:
    """The job file (its runPolicy: restart escalation and log rules) for ``tierckpt run --job``."""
    import yaml

    body = yaml.safe_dump(spec.run_policy, sort_keys=False)  # a bare runPolicy mapping (--job accepts it)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(spec, spec.configmap_name),
            "data": {"job.yaml": body}}


def secret(spec: RenderSpec) -> dict[str, Any] | None:
    """The peer-replication secret (HMAC key of the node agents), unless it exists already."""
    if spec.secret_value is None:
        return None
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": _meta(spec, spec.secret_name),
            "stringData": {"secret": spec.secret_value}}


def _run_command(spec: RenderSpec, endpoint: str, peers: list[str]) -> list[str]:
    args = ["--nnodes", spec.nnodes, "--rdzv-backend", "tierckpt", "--rdzv-endpoint", endpoint,
            "--rdzv-id", spec.name, "--job", f"{JOB_FILE_DIR}/job.yaml", "--memory-dir", spec.memory_dir,
            "--metrics-port", str(spec.metrics_port)]
    if spec.hosted_agent:
        # every pod's stable name; an agent skips itself, and retries peers not up yet
        args += ["--agent-listen", f"0.0.0.0:{spec.agent_port}", "--agent-secret-file", f"{SECRET_DIR}/secret",
                 "--peers", ",".join(f"{host}:{spec.agent_port}" for host in peers)]
    return args + spec.run_args


def _pod_template(spec: RenderSpec, endpoint: str, peers: list[str], *, wrapper: bool) -> dict[str, Any]:
    tmpl = copy.deepcopy(spec.pod_template)
    pod = tmpl.setdefault("spec", {})
    meta = tmpl.setdefault("metadata", {})
    # HyperPod's pods carry job-name; the Job controller sets that label itself
    meta["labels"] = {k: v for k, v in (meta.get("labels") or {}).items() if k != "job-name"}
    meta.setdefault("annotations", {}).update({"prometheus.io/scrape": "true",
                                               "prometheus.io/port": str(spec.metrics_port)})
    pod["restartPolicy"] = "Never"  # podFailurePolicy requires it; restarts are the controller's
    c = pod["containers"][0]
    args = _run_command(spec, endpoint, peers)
    if wrapper:
        c["command"] = ["/bin/sh", "-c", RETRY_WRAPPER, "tierckpt-run"]
    else:
        c["command"] = ["tierckpt", "run"]
    c["args"] = args
    env = [e for e in c.get("env", []) if not e.get("name", "").startswith("TIERCKPT_METRICS_")
           and e.get("name") != "TIERCKPT_NODE_NAME"]
    env += [{"name": "TIERCKPT_METRICS_PORT", "value": str(spec.library_metrics_port)},
            {"name": "TIERCKPT_METRICS_HOST", "value": "0.0.0.0"},
            # the node's name, which a full restart's avoid list names (not the pod's host name)
            {"name": "TIERCKPT_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    avoid_nodes(pod, spec.name)
    c["env"] = env
    ports = [p for p in c.get("ports", []) if p.get("name") not in ("rdzv", "agent", "metrics")]
    ports += [{"name": "rdzv", "containerPort": spec.rdzv_port, "protocol": "TCP"},
              {"name": "metrics", "containerPort": spec.metrics_port, "protocol": "TCP"}]
    if spec.hosted_agent:
        ports.append({"name": "agent", "containerPort": spec.agent_port, "protocol": "TCP"})
    c["ports"] = ports
    mounts = c.setdefault("volumeMounts", [])
    volumes = pod.setdefault("volumes", [])
    mounts.append({"name": "tierckpt-job", "mountPath": JOB_FILE_DIR, "readOnly": True})
    volumes.append({"name": "tierckpt-job", "configMap": {"name": spec.configmap_name}})
    mounts.append({"name": "tierckpt-secret", "mountPath": SECRET_DIR, "readOnly": True})
    volumes.append({"name": "tierckpt-secret", "secret": {"secretName": spec.secret_name}})
    if not any(spec.memory_dir.startswith(m["mountPath"].rstrip("/") + "/") or spec.memory_dir == m["mountPath"]
               for m in mounts):
        # the memory tier on the node's tmpfs: it outlives the pod, so a recreated pod on the
        # same node resumes from memory
        mounts.append({"name": "tierckpt-memory", "mountPath": spec.memory_dir})
        volumes.append({"name": "tierckpt-memory", "hostPath": {"path": spec.memory_dir, "type": "DirectoryOrCreate"}})
    return tmpl


def avoid_nodes(pod: dict[str, Any], job: str) -> None:
    """Require, in the pod spec ``pod``, a node not labelled ``tierckpt.io/avoid=<job>`` (absent
    or another value): added to every required term of the template's own node affinity (the
    terms are ORed, their expressions ANDed), or as the only term."""
    expr = {"key": AVOID_LABEL, "operator": "NotIn", "values": [job]}
    node = pod.setdefault("affinity", {}).setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:
        exprs = term.setdefault("matchExpressions", [])
        if expr not in exprs:
            exprs.append(expr)


def jobset(spec: RenderSpec) -> dict[str, Any]:
    """A JobSet (jobset.x-k8s.io/v1alpha2): one indexed Job of ``nodes + spares`` pods, one per node."""
    rjob = "node"
    endpoint = f"{spec.name}-{rjob}-0-0.{spec.name}:{spec.rdzv_port}"
    peers = [f"{spec.name}-{rjob}-0-{i}.{spec.name}" for i in range(spec.pods)]  # JobSet's pod hostnames
    template = _pod_template(spec, endpoint, peers, wrapper=False)
    job_spec = {
        "parallelism": spec.pods, "completions": spec.pods, "completionMode": "Indexed", "backoffLimit": 0,
        "podFailurePolicy": {"rules": [
            {"action": "FailJob", "onExitCodes": {"containerName": template["spec"]["containers"][0]["name"],
                                                  "operator": "In",
                                                  "values": [EXIT_FULL_RESTART]}},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]},
        "template": template,
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": _meta(spec, spec.name, job=True),
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": spec.name},
            "failurePolicy": {
                "maxRestarts": spec.max_full_restarts,
                "rules": [
                    {"name": "FullJobRestart", "action": "RestartJobSet", "onJobFailureReasons": ["PodFailurePolicy"]},
                    {"name": "JobFailed", "action": "FailJobSet", "onJobFailureReasons": ["BackoffLimitExceeded"]},
                ],
            },
            "successPolicy": {"operator": "All"},
            "replicatedJobs": [{"name": rjob, "replicas": 1, "template": {"spec": job_spec}}],
        },
    }


def pytorchjob(spec: RenderSpec) -> dict[str, Any]:
    """A Kubeflow PyTorchJob (kubeflow.org/v1): one Master pod and ``nodes + spares - 1`` Worker pods."""
    endpoint = f"{spec.name}-master-0:{spec.rdzv_port}"
    # the operator's per-pod headless Services
    peers = [f"{spec.name}-master-0"] + [f"{spec.name}-worker-{i}" for i in range(spec.pods - 1)]
    replicas: dict[str, Any] = {"Master": {"replicas": 1, "restartPolicy": "ExitCode",
                                           "template": _pod_template(spec, endpoint, peers, wrapper=True)}}
    if spec.pods > 1:
        replicas["Worker"] = {"replicas": spec.pods - 1, "restartPolicy": "ExitCode",
                              "template": _pod_template(spec, endpoint, peers, wrapper=True)}
    for r in replicas.values():  # the operator requires its container name
        r["template"]["spec"]["containers"][0]["name"] = "pytorch"
    return {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": _meta(spec, spec.name, job=True),
        "spec": {
            "runPolicy": {"cleanPodPolicy": "All",
                          # every pod exits 175 in a full restart; tierckpt enforces maxFullJobRestarts itself
                          "backoffLimit": (spec.max_full_restarts + 1) * spec.pods},
            "pytorchReplicaSpecs": replicas,
        },
    }
