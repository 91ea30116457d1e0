"""``spec.elasticPolicy`` in full (issue 28 item 4): the allowed node counts parsed with typed
errors naming the field, and the pure decisions that keep a job off a forbidden count (the run-time
scenario is tests/launcher/test_elastic_policy.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tierckpt.errors import ConfigError
from tierckpt.launcher.jobspec import JobSpecError, parse_job
from tierckpt.launcher.membership.change import Elastic, shrink


def _job(elastic: dict[str, Any], replica_max: int | None = None) -> Any:
    spec: dict[str, Any] = {"elasticPolicy": elastic}
    if replica_max is not None:
        spec["replicaSpecs"] = [{"name": "pods", "replicas": 2, "maxReplicas": replica_max}]
    return parse_job({"kind": "HyperPodPyTorchJob", "spec": spec})


def test_discrete_values_step_and_timeouts_are_read() -> None:
    job = _job({"minReplicas": 2, "maxReplicas": 8, "replicaDiscreteValues": [8, 2, 4],
                "scalingTimeoutInSeconds": 60, "gracefulShutdownTimeoutInSeconds": 30,
                "faultyScaleDownTimeoutInSeconds": 0})
    el = job.elastic_policy
    assert job.elastic == (2, 8) and el.allowed == (2, 4, 8) and el.discrete_values == (2, 4, 8)
    assert (el.scaling_timeout_s, el.graceful_shutdown_timeout_s, el.faulty_scale_down_timeout_s) == (60.0, 30.0, 0.0)
    assert job.ignored_fields == ()  # acted on (below), so no warning lists them
    assert _job({"minReplicas": 1, "maxReplicas": 8, "replicaIncrementStep": 3}).elastic_policy.allowed == (1, 4, 7)
    assert _job({"minReplicas": 2, "maxReplicas": 4}).elastic_policy.allowed == (2, 3, 4)
    assert _job({"minReplicas": 2}, replica_max=6).elastic == (2, 6)  # replicaSpecs[0].maxReplicas is MAX


@pytest.mark.parametrize(("elastic", "replica_max", "message"), [
    ({"minReplicas": 2, "maxReplicas": 8, "replicaDiscreteValues": [4, 8]}, None, "leaves out minReplicas (2)"),
    ({"minReplicas": 2, "maxReplicas": 8, "replicaDiscreteValues": [2, 16]}, None, "[16] outside minReplicas..maxReplicas"),
    ({"minReplicas": 2, "maxReplicas": 8, "replicaDiscreteValues": [2, 2]}, None, "lists a node count twice"),
    ({"minReplicas": 2, "maxReplicas": 8, "replicaDiscreteValues": []}, None, "must be a non-empty list"),
    ({"minReplicas": 2, "maxReplicas": 8, "replicaDiscreteValues": [2, "4"]}, None, "replicaDiscreteValues[1]"),
    ({"minReplicas": 2, "maxReplicas": 8, "replicaDiscreteValues": [2, 8], "replicaIncrementStep": 2}, None,
     "exclude each other"),
    ({"minReplicas": 2, "maxReplicas": 8, "replicaIncrementStep": 0}, None, "replicaIncrementStep: must be at least 1"),
    ({"minReplicas": 2, "maxReplicas": 8, "faultyScaleDownTimeoutInSeconds": -1}, None,
     "faultyScaleDownTimeoutInSeconds: must be zero or more"),
    ({"minReplicas": 2, "maxReplicas": 8}, 6, "spec.replicaSpecs[0].maxReplicas: 6 differs"),
])
def test_forbidden_sets_are_typed_errors_naming_the_field(elastic: dict[str, Any], replica_max: int | None,
                                                           message: str) -> None:
    with pytest.raises(JobSpecError) as info:
        _job(elastic, replica_max)
    assert message in str(info.value) and isinstance(info.value, ConfigError)


def test_the_job_never_settles_on_a_forbidden_count() -> None:
    el = Elastic(1, 3, (1, 3))
    assert [el.allows(n) for n in range(5)] == [False, True, False, True, False]
    assert [el.floor(n) for n in range(5)] == [None, 1, 1, 3, 3]
    # 3 nodes lose 1: the two survivors may not run together; the lower rank goes on, the other waits
    plan = shrink(nnodes=3, lost=[2], elastic=el, spares_waiting=0)
    assert (plan.regroup, plan.survivors, plan.surplus) == (True, (0,), (1,)) and "[1, 3]" in plan.why
    assert shrink(nnodes=3, lost=[0], elastic=el, spares_waiting=0).survivors == (1,)
    # a spare waiting: torch's round, as before
    assert not shrink(nnodes=3, lost=[2], elastic=el, spares_waiting=1).regroup
    # growing: one waiting node makes 2 (forbidden), two make 3
    assert not el.grows(1, 1) and el.grows(1, 2) and not el.grows(3, 1) and not el.grows(1, 0)
    every = Elastic(1, 3)  # no allowed set: every count, as before
    assert every.grows(1, 1) and shrink(nnodes=3, lost=[2], elastic=every, spares_waiting=0).survivors == (0, 1)
    with pytest.raises(ConfigError, match="ascending, from MIN"):
        Elastic(2, 4, (3, 4))


def test_the_timeouts_become_the_last_call_the_stop_grace_and_the_scale_down_wait(tmp_path: Any) -> None:
    """scalingTimeoutInSeconds → the rendezvous' last_call_timeout, gracefulShutdownTimeoutInSeconds
    → the workers' SIGTERM grace, faultyScaleDownTimeoutInSeconds → Elastic.scale_down_wait_s; the
    command line wins where it set one."""
    from tierckpt.launcher.cli import _options, build_parser

    path = tmp_path / "job.yaml"
    path.write_text("kind: HyperPodPyTorchJob\nspec:\n  elasticPolicy:\n    minReplicas: 1\n    maxReplicas: 3\n"
                    "    scalingTimeoutInSeconds: 7\n    gracefulShutdownTimeoutInSeconds: 4\n"
                    "    faultyScaleDownTimeoutInSeconds: 12\n")
    args = build_parser().parse_args(["--job", str(path), "--memory-dir", str(tmp_path / "m"), "train.py"])
    opts = _options(args)
    assert "last_call_timeout=7" in args.rdzv_conf and opts.stop_grace_s == 4.0
    assert opts.elastic is not None and opts.elastic.scale_down_wait_s == 12.0
    args = build_parser().parse_args(["--job", str(path), "--memory-dir", str(tmp_path / "m"), "--stop-grace", "1",
                                      "--rdzv-conf", "last_call_timeout=2", "train.py"])
    opts = _options(args)
    assert args.rdzv_conf == "last_call_timeout=2" and opts.stop_grace_s == 1.0
