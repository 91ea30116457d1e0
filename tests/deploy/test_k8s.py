"""``tierckpt k8s render`` on the seed's job shape, and every manifest validated offline.

No cluster is reachable here: built-in kinds are validated with kubernetes-validate (the
Kubernetes OpenAPI schemas, strict: unknown fields fail); JobSet and PyTorchJob with trimmed
schemas vendored in tests/deploy/schemas (their sources are in each file's $comment), and their
Job / pod templates with kubernetes-validate. deploy/k8s/e2e.sh runs on a real cluster.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

from tierckpt.agent.cli import add_arguments  # noqa: E402
from tierckpt.agent.config import parse_budget  # noqa: E402
from tierckpt.cli import main as cli_main  # noqa: E402
from tierckpt.deploy.k8s_manifests import RETRY_WRAPPER  # noqa: E402
from tierckpt.launcher.cli import build_parser  # noqa: E402
from tierckpt.launcher.jobspec import load_job_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "deploy" / "k8s" / "examples" / "llama3_1_8b-fsdp-hpto.yaml"
SCHEMAS = Path(__file__).parent / "schemas"
K8S_VERSION = "1.33"


def k8s_validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def crd_validate(doc: dict[str, Any], schema_file: str) -> None:
    schema = json.loads((SCHEMAS / schema_file).read_text())
    jsonschema.validate(doc, schema)


def render(tmp_path: Path, *extra: str, job: Path = SEED) -> list[dict[str, Any]]:
    out = tmp_path / "out.yaml"
    assert cli_main(["k8s", "render", str(job), "-o", str(out), *extra]) == 0
    return [d for d in yaml.safe_load_all(out.read_text()) if d]


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in docs}


def validate_pod_template(tmpl: dict[str, Any]) -> None:
    k8s_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": tmpl})


def run_args(container: dict[str, Any]) -> Any:
    """The container's tierckpt run arguments, parsed by the launcher's own (torchrun's) parser."""
    return build_parser().parse_args(container["args"])


def test_jobset_from_the_seed_job(tmp_path: Path) -> None:
    docs = by_kind(render(tmp_path, "--durable-url", "s3://bucket/ckpt", "--memory-budget", "40%"))
    assert set(docs) == {"ConfigMap", "Secret", "JobSet"}
    k8s_validate(docs["ConfigMap"])
    k8s_validate(docs["Secret"])
    js = docs["JobSet"]
    crd_validate(js, "jobset.x-k8s.io_v1alpha2.json")
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "hyperpod-ns-training-localqueue"
    (rjob,) = js["spec"]["replicatedJobs"]
    job_spec = rjob["template"]["spec"]
    k8s_validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": job_spec})
    assert job_spec["parallelism"] == job_spec["completions"] == 4 and job_spec["completionMode"] == "Indexed"

    # exit 75 -> Job fails by PodFailurePolicy -> the JobSet restarts everything (maxFullJobRestarts: 1)
    pod = job_spec["template"]["spec"]
    trainer = pod["containers"][0]
    fail, ignore = job_spec["podFailurePolicy"]["rules"]
    assert fail["action"] == "FailJob" and fail["onExitCodes"] == {
        "containerName": trainer["name"], "operator": "In", "values": [75]}
    assert ignore["action"] == "Ignore" and ignore["onPodConditions"][0]["type"] == "DisruptionTarget"
    assert pod["restartPolicy"] == "Never" and job_spec["backoffLimit"] == 0
    policy = js["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 1
    assert policy["rules"][0] == {"name": "FullJobRestart", "action": "RestartJobSet",
                                  "onJobFailureReasons": ["PodFailurePolicy"]}
    assert policy["rules"][1]["action"] == "FailJobSet"

    # the command: tierckpt run with the seed's torchrun options and script, our rendezvous
    assert trainer["command"] == ["tierckpt", "run"]
    a = run_args(trainer)
    assert a.nnodes == "4" and a.nproc_per_node == "8" and a.rdzv_backend == "tierckpt"
    assert a.rdzv_endpoint == "llama3-1-8b-fsdp-node-0-0.llama3-1-8b-fsdp:29400"
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": "llama3-1-8b-fsdp"}
    assert a.rdzv_id == "llama3-1-8b-fsdp" and a.tee == "3" and a.log_dir == "/tmp/hyperpod"
    assert a.training_script == "/fsdp/train.py"
    assert a.training_script_args == ["--max_context_width=8192", "--checkpoint_dir=/fsx/checkpoints",
                                      "--resume_from_checkpoint=/fsx/checkpoints"]
    assert (a.durable_url, a.memory_budget, a.replicas) == ("s3://bucket/ckpt", "40%", 1)
    assert a.peers == ",".join(f"llama3-1-8b-fsdp-node-0-{i}.llama3-1-8b-fsdp:7601" for i in range(4))
    assert a.memory_dir == "/dev/shm/tierckpt" and a.metrics_port == 9400

    # the job file from the ConfigMap, the secret from the Secret, the memory tier on the host
    mounts = {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    job_dir, job_name = os.path.split(a.job)
    assert volumes[mounts[job_dir]]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    (tmp_path / job_name).write_text(docs["ConfigMap"]["data"][job_name])
    job_file = load_job_file(tmp_path / job_name)  # as tierckpt run --job reads the mounted file
    assert [r.name for r in job_file.run_policy.log_rules] == ["JobStart", "JobHangingDetection",
                                                               "NoSCheckpointingDetection"]
    assert job_file.run_policy.job_max_retry_count == 10
    secret_dir = os.path.dirname(a.agent_secret_file)
    assert volumes[mounts[secret_dir]]["secret"]["secretName"] == docs["Secret"]["metadata"]["name"]
    assert len(docs["Secret"]["stringData"]["secret"]) == 64
    assert volumes[mounts["/dev/shm"]]["hostPath"]["path"] == "/dev/shm"  # the seed's own shm mount holds it
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["TIERCKPT_METRICS_PORT"] == "9410" and env["LOGLEVEL"] == "INFO"


def test_pytorchjob_from_the_seed_job(tmp_path: Path) -> None:
    docs = by_kind(render(tmp_path, "--target", "pytorchjob", "--secret-name", "shared"))
    assert set(docs) == {"ConfigMap", "PyTorchJob"}  # an existing secret is not rendered
    pj = docs["PyTorchJob"]
    crd_validate(pj, "kubeflow.org_v1_pytorchjob.json")
    specs = pj["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 3  # the operator allows 1 master
    for rs in specs.values():
        validate_pod_template(rs["template"])
        assert rs["restartPolicy"] == "ExitCode"
        c = rs["template"]["spec"]["containers"][0]
        assert c["name"] == "pytorch"  # the operator's container name
        assert c["command"][:2] == ["/bin/sh", "-c"] and c["command"][2] == RETRY_WRAPPER
        a = run_args(c)
        assert a.rdzv_endpoint == "llama3-1-8b-fsdp-master-0:29400" and a.nnodes == "4"
        assert a.peers == ("llama3-1-8b-fsdp-master-0:7601,llama3-1-8b-fsdp-worker-0:7601,"
                           "llama3-1-8b-fsdp-worker-1:7601,llama3-1-8b-fsdp-worker-2:7601")
        vols = {v["name"]: v for v in rs["template"]["spec"]["volumes"]}
        assert vols["tierckpt-secret"]["secret"]["secretName"] == "shared"


def test_daemonset_mode_and_own_memory_mount(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    doc = yaml.safe_load(SEED.read_text())
    tmpl = doc["spec"]["replicaSpecs"][0]["template"]["spec"]
    tmpl.pop("volumes")
    tmpl["containers"][0].pop("volumeMounts")
    tmpl["containers"][0]["command"] = ["torchrun", "--nnodes", "9", "--rdzv_endpoint", "x:1", "--standalone",
                                        "--nproc-per-node", "2", "train.py", "--nnodes", "kept"]
    job.write_text(yaml.safe_dump(doc))
    docs = by_kind(render(tmp_path, "--node-agent", "daemonset", job=job))
    pod = docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    k8s_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                  "template": {"spec": pod}})
    a = run_args(pod["containers"][0])
    assert a.nnodes == "4" and a.nproc_per_node == "2" and not a.standalone and a.rdzv_endpoint.endswith(":29400")
    assert a.training_script_args == ["--nnodes", "kept"]  # the script's own arguments are untouched
    assert a.replicas is None and a.agent_listen is None and a.peers is None  # the DaemonSet's agent serves
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["tierckpt-memory"]["hostPath"] == {"path": "/dev/shm/tierckpt", "type": "DirectoryOrCreate"}


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["spec"]["replicaSpecs"].append(d["spec"]["replicaSpecs"][0]), "spec.replicaSpecs: has 2 entries"),
    (lambda d: d["spec"]["replicaSpecs"][0].update(replicas=0), "replicas: must be a whole number"),
    (lambda d: d["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0].update(command=["python", "t.py"]),
     "must start with one of hyperpodrun"),
    (lambda d: d["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0].update(
        command=["hyperpodrun", "--nproc_per_node=8"]), "names no training script"),
    (lambda d: d["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0].update(
        command=["hyperpodrun", "--bogus=1", "t.py"]), "--bogus is not a torchrun"),
    (lambda d: d["spec"]["runPolicy"].update(jobMaxRetryCount=-1), "jobMaxRetryCount: must be at least 0"),
])
def test_bad_jobs_are_refused_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               change: Any, message: str) -> None:
    doc = yaml.safe_load(SEED.read_text())
    change(doc)
    job = tmp_path / "bad.yaml"
    job.write_text(yaml.safe_dump(doc))
    assert cli_main(["k8s", "render", str(job)]) == 2
    assert message in capsys.readouterr().err


def test_base_manifests_validate_and_tie_the_limit_to_the_budget() -> None:
    base = ROOT / "deploy" / "k8s" / "base"
    kust = yaml.safe_load((base / "kustomization.yaml").read_text())
    docs: dict[str, dict[str, Any]] = {}
    for name in kust["resources"]:
        for d in yaml.safe_load_all((base / name).read_text()):
            k8s_validate(d)
            docs[d["kind"]] = d
    assert set(docs) == {"Namespace", "ConfigMap", "DaemonSet"}
    ds, cm = docs["DaemonSet"], docs["ConfigMap"]["data"]
    c = ds["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    # $(VAR) expanded as the kubelet does, then parsed by the agent's own parser
    values = {n: cm[e["valueFrom"]["configMapKeyRef"]["key"]] for n, e in env.items() if "valueFrom" in e
              and "configMapKeyRef" in e["valueFrom"]}
    values["NODE_NAME"] = "node-a"
    args = [_expand(a, values) for a in c["args"]]
    p = argparse.ArgumentParser()
    add_arguments(p)
    ns = p.parse_args(["serve", *args])
    assert ns.memory_dir == "/dev/shm/tierckpt" and ns.metrics_port == 9401 and ns.node_id == "node-a"
    budget = parse_budget(ns.memory_budget, 1 << 40)  # the agent's own reading (G = GiB)
    limit = _bytes(c["resources"]["limits"]["memory"])
    assert 1 << 30 <= limit - budget <= 4 << 30, (budget, limit)
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert vols["memory-tier"]["hostPath"]["path"] == mounts["memory-tier"] == ns.memory_dir
    assert env["TIERCKPT_METRICS_HOST"]["value"] == "0.0.0.0"


def _expand(arg: str, values: dict[str, str]) -> str:
    for k, v in values.items():
        arg = arg.replace(f"$({k})", v)
    return arg


def _bytes(q: str) -> int:
    """A Kubernetes memory quantity in bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "K": 10**3, "M": 10**6, "G": 10**9,
             "T": 10**12}
    for u in sorted(units, key=len, reverse=True):
        if q.endswith(u):
            return int(float(q[: -len(u)]) * units[u])
    return int(q)


def _fake_tierckpt(tmp_path: Path, body: str) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    fake = bindir / "tierckpt"
    fake.write_text("#!/bin/sh\n" + body)
    fake.chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}


@pytest.mark.parametrize(("code", "expected"), [(75, 175), (1, 1), (0, 0), (143, 143)])
def test_pytorchjob_wrapper_maps_the_full_restart_code(tmp_path: Path, code: int, expected: int) -> None:
    env = _fake_tierckpt(tmp_path, f'echo "$@" > "{tmp_path}/argv"\nexit {code}\n')
    rc = subprocess.run(["/bin/sh", "-c", RETRY_WRAPPER, "tierckpt-run", "--nnodes", "2", "train.py", "a b"],
                        env=env, timeout=30).returncode
    assert rc == expected
    assert (tmp_path / "argv").read_text().split("\n")[0] == "run --nnodes 2 train.py a b"


def test_pytorchjob_wrapper_forwards_sigterm(tmp_path: Path) -> None:
    """The kubelet's SIGTERM reaches tierckpt run (so it persists the newest step), and its code is kept."""
    ready, got = tmp_path / "ready", tmp_path / "got-term"
    env = _fake_tierckpt(tmp_path, f"trap 'touch {shlex.quote(str(got))}; exit 143' TERM\n"
                                   f"touch {shlex.quote(str(ready))}\nwhile :; do sleep 0.05; done\n")
    proc = subprocess.Popen(["/bin/sh", "-c", RETRY_WRAPPER, "tierckpt-run", "x.py"], env=env)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:  # wait for the child to start
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
    assert got.exists()


def test_the_validators_reject_what_a_cluster_would(tmp_path: Path) -> None:
    """The offline checks bite: a misspelled field or a bad enum fails each of them."""
    js = by_kind(render(tmp_path))["JobSet"]
    bad = json.loads(json.dumps(js))
    bad["spec"]["failurePolicy"]["rules"][0]["action"] = "RestartJob"
    with pytest.raises(jsonschema.ValidationError):
        crd_validate(bad, "jobset.x-k8s.io_v1alpha2.json")
    bad = json.loads(json.dumps(js))
    bad["spec"]["replicatedJob"] = bad["spec"].pop("replicatedJobs")
    with pytest.raises(jsonschema.ValidationError):
        crd_validate(bad, "jobset.x-k8s.io_v1alpha2.json")
    job_spec = json.loads(json.dumps(js["spec"]["replicatedJobs"][0]["template"]["spec"]))
    job_spec["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(jsonschema.ValidationError):
        k8s_validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": job_spec})


def _seed_with(tmp_path: Path, change: Any) -> Path:
    doc = yaml.safe_load(SEED.read_text())
    change(doc)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    return job


def test_jobset_renders_the_spares_of_the_replica_spec(tmp_path: Path) -> None:
    """HyperPod's ``replicaSpecs[].spares``: that many more pods of the same template, all running the
    same ``tierckpt run --nnodes 4``, so whichever pod comes fifth finds the job full and waits at the
    spare gate; every pod is a peer (a spare that takes a rank loads it from the others' replicas)."""
    job = _seed_with(tmp_path, lambda d: d["spec"]["replicaSpecs"][0].update(spares=1))
    js = by_kind(render(tmp_path, job=job))["JobSet"]
    crd_validate(js, "jobset.x-k8s.io_v1alpha2.json")
    job_spec = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    k8s_validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": job_spec})
    assert job_spec["parallelism"] == job_spec["completions"] == 5
    a = run_args(job_spec["template"]["spec"]["containers"][0])
    assert a.nnodes == "4"  # one pod more than the job's nodes: a spare
    assert a.peers == ",".join(f"llama3-1-8b-fsdp-node-0-{i}.llama3-1-8b-fsdp:7601" for i in range(5))
    # --spares overrides the job file, 0 included
    none = by_kind(render(tmp_path, "--spares", "0", job=job))["JobSet"]["spec"]["replicatedJobs"][0]
    assert none["template"]["spec"]["completions"] == 4


def test_pytorchjob_renders_spares_as_more_workers(tmp_path: Path) -> None:
    pj = by_kind(render(tmp_path, "--target", "pytorchjob", "--spares", "2"))["PyTorchJob"]
    crd_validate(pj, "kubeflow.org_v1_pytorchjob.json")
    specs = pj["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 5
    master, worker = (run_args(specs[k]["template"]["spec"]["containers"][0]) for k in ("Master", "Worker"))
    assert vars(master) == vars(worker)  # the spares start tierckpt run exactly as the nodes do
    assert master.nnodes == "4" and master.peers.split(",")[-1] == "llama3-1-8b-fsdp-worker-4:7601"
    assert pj["spec"]["runPolicy"]["backoffLimit"] == (1 + 1) * 6  # maxFullJobRestarts 1, six pods
    for rs in specs.values():
        validate_pod_template(rs["template"])


def test_elastic_policy_becomes_nnodes_min_max_and_spares_wait_beyond_max(tmp_path: Path) -> None:
    """The ConfigMap holds only the runPolicy, so the elasticPolicy's range must reach --nnodes."""
    from tierckpt.launcher.membership.change import Elastic

    def elastic(d: dict[str, Any]) -> None:
        d["spec"]["elasticPolicy"] = {"minReplicas": 2, "maxReplicas": 4}
        d["spec"]["replicaSpecs"][0]["spares"] = 1

    js = by_kind(render(tmp_path, job=_seed_with(tmp_path, elastic)))["JobSet"]
    job_spec = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    el = Elastic.parse(run_args(job_spec["template"]["spec"]["containers"][0]).nnodes)
    assert (el.min_nodes, el.max_nodes) == (2, 4)
    assert job_spec["completions"] - el.max_nodes == 1  # one pod beyond MAX: the spare


@pytest.mark.parametrize(("change", "extra", "message"), [
    (lambda d: d["spec"]["replicaSpecs"][0].update(spares=-1), (), "spec.replicaSpecs[0].spares: must be a whole"),
    (lambda d: d["spec"]["replicaSpecs"][0].update(spares="one"), (), "spec.replicaSpecs[0].spares: must be a whole"),
    (lambda d: None, ("--spares", "-2"), "--spares: must be a whole number"),
    (lambda d: d["spec"].update(elasticPolicy={"minReplicas": 1, "maxReplicas": 2}), (),
     "replicas: 4 is outside elasticPolicy's 1..2"),
])
def test_bad_spares_are_refused_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 change: Any, extra: tuple[str, ...], message: str) -> None:
    job = _seed_with(tmp_path, change)
    assert cli_main(["k8s", "render", str(job), *extra]) == 2
    assert message in capsys.readouterr().err


def _pod_specs(docs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    if "JobSet" in docs:
        return [docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]]
    return [r["template"]["spec"] for r in docs["PyTorchJob"]["spec"]["pytorchReplicaSpecs"].values()]


@pytest.mark.parametrize("target", ["jobset", "pytorchjob"])
def test_every_pod_avoids_nodes_labelled_for_this_job_and_knows_its_node(tmp_path: Path, target: str) -> None:
    """A full job restart's repeat offender: a node labelled ``tierckpt.io/avoid=<job>`` gets no
    pod of the job (the other jobs' labels do not matter); each pod's launcher knows its node."""
    docs = by_kind(render(tmp_path, "--target", target))
    for pod in _pod_specs(docs):
        validate_pod_template({"metadata": {}, "spec": pod})
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms == [{"matchExpressions": [{"key": "tierckpt.io/avoid", "operator": "NotIn",
                                                "values": ["llama3-1-8b-fsdp"]}]}]
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        assert env["TIERCKPT_NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    if target == "jobset":
        crd_validate(docs["JobSet"], "jobset.x-k8s.io_v1alpha2.json")
    else:
        crd_validate(docs["PyTorchJob"], "kubeflow.org_v1_pytorchjob.json")


def test_the_avoid_rule_is_anded_into_the_templates_own_node_affinity(tmp_path: Path) -> None:
    job = yaml.safe_load(SEED.read_text())
    own = [{"matchExpressions": [{"key": "node.kubernetes.io/instance-type", "operator": "In",
                                  "values": ["ml.p5.48xlarge"]}]},
           {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]
    pod = job["spec"]["replicaSpecs"][0]["template"]["spec"]
    pod["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": copy.deepcopy(own)}}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    (spec,) = _pod_specs(by_kind(render(tmp_path, job=path)))
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    rule = {"key": "tierckpt.io/avoid", "operator": "NotIn", "values": ["llama3-1-8b-fsdp"]}
    assert terms == [{"matchExpressions": [*t["matchExpressions"], rule]} for t in own]  # each term ANDs it
    validate_pod_template({"metadata": {}, "spec": spec})
