from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tierckpt.errors import ConfigError, TierckptError
from tierckpt.launcher.jobspec import (
    OPERATORS,
    JobFile,
    JobSpecError,
    LogRule,
    RestartPolicy,
    RunPolicy,
    load_job_file,
    parse_job,
    parse_run_policy,
)

# The shape of the seed's llama3_1_8b-fsdp-hpto.yaml, with its three log rules verbatim.
SEED_YAML = """\
apiVersion: sagemaker.amazonaws.com/v1
kind: HyperPodPyTorchJob
metadata:
  name: llama3-1-8b-fsdp
  namespace: kubeflow
  labels:
    kueue.x-k8s.io/queue-name: hyperpod-ns-training-localqueue
spec:
  nprocPerNode: "8"
  replicaSpecs:
    - name: pods
      replicas: 4
      template:
        metadata:
          labels:
            job-name: llama3-1-8b-fsdp
        spec:
          volumes:
            - name: shmem
              hostPath:
                path: /dev/shm
          containers:
            - name: pytorch
              image: ${REGISTRY}fsdp:pytorch2.7.1
              imagePullPolicy: Always
              resources:
                requests:
                  nvidia.com/gpu: 8
                  vpc.amazonaws.com/efa: 32
                limits:
                  nvidia.com/gpu: 8
                  vpc.amazonaws.com/efa: 32
              env:
                - name: LOGLEVEL
                  value: "INFO"
                - name: NCCL_DEBUG
                  value: "INFO"
              command:
                - hyperpodrun
                - --tee=3
                - --log_dir=/tmp/hyperpod
                - --nproc_per_node=8
                - --nnodes=4
                - /fsdp/train.py
                - --max_context_width=8192
                - --checkpoint_dir=/fsx/checkpoints
                - --resume_from_checkpoint=/fsx/checkpoints
              volumeMounts:
                - name: shmem
                  mountPath: /dev/shm
  runPolicy:
    jobMaxRetryCount: 10
    restartPolicy:
      numRestartBeforeFullJobRestart: 3
      evalPeriodSeconds: 21600
      maxFullJobRestarts: 1
    cleanPodPolicy: "All"
    logMonitoringConfiguration:
      - name: "JobStart"
        logPattern: ".*Loss:.*"
        expectedStartCutOffInSeconds: 240 # job should print loss within 4 mins of start time
      - name: "JobHangingDetection"
        logPattern: ".*Loss:.*"
        expectedRecurringFrequencyInSeconds: 300 # if next batch is not printed within 300 seconds
      - name: "NoSCheckpointingDetection"
        logPattern: ".*Completed checkpoint.*"
        expectedRecurringFrequencyInSeconds: 600 # If next checkpoint upload doesn't happen within 10 mins, mark it hang.
        expectedStartCutOffInSeconds: 900 # Allow 30 minutes for first checkpoint upload
"""


def _rule(**fields: Any) -> dict[str, Any]:
    return {"name": "r", "logPattern": ".*Loss: ([0-9.]+).*", **fields}


def _policy(**fields: Any) -> RunPolicy:
    return parse_run_policy(fields)[0]


def _error(document: Any, *, run_policy: bool = True) -> str:
    with pytest.raises(JobSpecError) as info:
        if run_policy:
            parse_run_policy(document)
        else:
            parse_job(document)
    return str(info.value)


# --- the seed's job file -----------------------------------------------------------------------


def test_seed_job_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "llama3_1_8b-fsdp-hpto.yaml"
    path.write_text(SEED_YAML)
    job = load_job_file(path)
    rp = job.run_policy
    assert rp.job_max_retry_count == 10
    assert rp.restart_policy == RestartPolicy(
        num_restart_before_full_job_restart=3, eval_period_s=21600.0, max_full_job_restarts=1
    )
    assert [r.name for r in rp.log_rules] == ["JobStart", "JobHangingDetection", "NoSCheckpointingDetection"]
    start, hang, ckpt = rp.log_rules
    assert start.log_pattern.pattern == ".*Loss:.*"
    assert (start.expected_start_cutoff_s, start.expected_recurring_frequency_s) == (240.0, None)
    assert (hang.expected_start_cutoff_s, hang.expected_recurring_frequency_s) == (None, 300.0)
    assert ckpt.log_pattern.pattern == ".*Completed checkpoint.*"
    assert (ckpt.expected_start_cutoff_s, ckpt.expected_recurring_frequency_s) == (900.0, 600.0)
    for rule in rp.log_rules:
        assert rule.operator is None and rule.metric_threshold is None and rule.stop_pattern is None
        assert rule.metric_evaluation_data_points == 1 and rule.fault_on_match is False
    assert set(job.ignored_fields) == {
        "metadata",
        "spec.nprocPerNode",
        "spec.replicaSpecs",
        "spec.runPolicy.cleanPodPolicy",
    }
    assert rp.startup_deadline_s is None and rp.fault_deadline_s is None and rp.active_deadline_s is None


def test_seed_job_file_as_json(tmp_path: Path) -> None:
    import yaml

    document = yaml.safe_load(SEED_YAML)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(document))
    assert load_job_file(path) == load_job_file(_write(tmp_path / "job.yaml", SEED_YAML))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_bare_run_policy_yaml(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "rp.yaml",
        "jobMaxRetryCount: 2\nlogMonitoringConfiguration:\n  - name: a\n    logPattern: '.*x.*'\n",
    )
    job = load_job_file(path)
    assert job.run_policy.job_max_retry_count == 2
    assert job.run_policy.log_rules[0].name == "a"
    assert job.ignored_fields == ()


def test_multi_document_yaml_picks_the_job(tmp_path: Path) -> None:
    other = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n"
    path = _write(tmp_path / "all.yaml", other + "---\n" + SEED_YAML + "---\n")
    assert load_job_file(path).run_policy.job_max_retry_count == 10


def test_multi_document_yaml_without_a_job(tmp_path: Path) -> None:
    path = _write(tmp_path / "x.yaml", "kind: ConfigMap\n---\nkind: Service\n")
    with pytest.raises(JobSpecError, match="2 YAML documents and 0 of kind HyperPodPyTorchJob"):
        load_job_file(path)


def test_multi_document_yaml_with_two_jobs(tmp_path: Path) -> None:
    path = _write(tmp_path / "x.yaml", SEED_YAML + "---\n" + SEED_YAML)
    with pytest.raises(JobSpecError, match="2 of kind HyperPodPyTorchJob; keep exactly one"):
        load_job_file(path)


@pytest.mark.parametrize("text", ["", "---\n", "# only a comment\n"])
def test_empty_file(tmp_path: Path, text: str) -> None:
    with pytest.raises(JobSpecError, match="holds no document"):
        load_job_file(_write(tmp_path / "e.yaml", text))


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(JobSpecError, match="cannot read job file") as info:
        load_job_file(tmp_path / "absent.yaml")
    assert info.value.path == str(tmp_path / "absent.yaml")
    assert info.value.exit_code == ConfigError.exit_code


def test_bad_yaml_and_json(tmp_path: Path) -> None:
    with pytest.raises(JobSpecError, match="not valid YAML"):
        load_job_file(_write(tmp_path / "b.yaml", "a: [1, 2\n"))
    with pytest.raises(JobSpecError, match="not valid JSON"):
        load_job_file(_write(tmp_path / "b.json", "{'a': 1}"))


def test_file_errors_name_the_file_and_field(tmp_path: Path) -> None:
    path = _write(tmp_path / "j.yaml", SEED_YAML.replace("jobMaxRetryCount: 10", "jobMaxRetryCount: -1"))
    with pytest.raises(JobSpecError) as info:
        load_job_file(path)
    assert str(info.value).startswith(f"{path}: spec.runPolicy.jobMaxRetryCount: must be at least 0")


def test_error_hierarchy() -> None:
    assert issubclass(JobSpecError, ConfigError)
    assert issubclass(JobSpecError, TierckptError)
    assert issubclass(JobSpecError, ValueError)


# --- full-job documents ------------------------------------------------------------------------


def test_full_job_without_run_policy() -> None:
    job = parse_job({"apiVersion": "sagemaker.amazonaws.com/v1", "kind": "HyperPodPyTorchJob", "spec": {}})
    assert job == JobFile(RunPolicy(), ())


def test_full_job_detected_by_kind_alone() -> None:
    assert parse_job({"kind": "HyperPodPyTorchJob"}) == JobFile(RunPolicy(), ())


def test_full_job_ignored_fields() -> None:
    job = parse_job(
        {
            "kind": "HyperPodPyTorchJob",
            "metadata": {"name": "x"},
            "status": {"restartCount": 1},
            "spec": {
                "elasticPolicy": {"minReplicas": 1},
                "runPolicy": {"suspend": False, "workloadMode": "Deployment"},
            },
        }
    )
    assert job.ignored_fields == (
        "metadata",
        "status",
        "spec.runPolicy.suspend",
        "spec.runPolicy.workloadMode",
    )
    assert job.elastic == (1, 1)  # minReplicas alone: a fixed size


def test_elastic_policy_maps_to_nnodes() -> None:
    from tierckpt.launcher.cli import _job_nnodes

    job = parse_job({"kind": "HyperPodPyTorchJob",
                     "spec": {"elasticPolicy": {"minReplicas": 2, "maxReplicas": 4, "rdzvBackend": "c10d"}}})
    assert job.elastic == (2, 4) and job.ignored_fields == ("spec.elasticPolicy.rdzvBackend",)
    assert _job_nnodes("1:1", job.elastic) == "2:4"  # --nnodes not given
    assert _job_nnodes("2:4", job.elastic) == "2:4"
    with pytest.raises(TierckptError, match="disagree"):
        _job_nnodes("3", job.elastic)
    msg = _error({"kind": "HyperPodPyTorchJob", "spec": {"elasticPolicy": {"minReplicas": 3, "maxReplicas": 2}}},
                 run_policy=False)
    assert "spec.elasticPolicy.maxReplicas" in msg


def test_wrong_kind() -> None:
    msg = _error({"kind": "PyTorchJob", "spec": {}}, run_policy=False)
    assert msg.startswith("kind: 'PyTorchJob' is not supported")
    assert "HyperPodPyTorchJob" in msg


def test_unknown_spec_key_suggests() -> None:
    msg = _error({"kind": "HyperPodPyTorchJob", "spec": {"runPolicyy": {}}}, run_policy=False)
    assert msg == "spec.runPolicyy: unknown field; did you mean 'runPolicy'?"


def test_unknown_top_level_key() -> None:
    msg = _error({"kind": "HyperPodPyTorchJob", "specs": {}}, run_policy=False)
    assert msg == "job.specs: unknown field; did you mean 'spec'?"


def test_unknown_key_without_near_miss_lists_known_fields() -> None:
    msg = _error({"zzzzzz": 1})
    assert msg.startswith("runPolicy.zzzzzz: unknown field; known fields: jobMaxRetryCount, restartPolicy")


@pytest.mark.parametrize(
    "document, match",
    [
        ({"kind": "HyperPodPyTorchJob", "spec": []}, "spec: must be a mapping"),
        ({"kind": "HyperPodPyTorchJob", "apiVersion": 1}, "apiVersion: must be a string"),
        ({"kind": "HyperPodPyTorchJob", "spec": {"runPolicy": [1]}}, "spec.runPolicy: must be a mapping"),
        ([1, 2], "job file: must be a mapping"),
    ],
)
def test_full_job_shape_errors(document: Any, match: str) -> None:
    with pytest.raises(JobSpecError, match=re.escape(match)):
        parse_job(document)


def test_job_errors_use_spec_run_policy_path() -> None:
    doc = {
        "kind": "HyperPodPyTorchJob",
        "spec": {
            "runPolicy": {
                "logMonitoringConfiguration": [_rule(), _rule(name="b", operator="gte", metricThreshold=1)]
            }
        },
    }
    msg = _error(doc, run_policy=False)
    assert (
        msg
        == "spec.runPolicy.logMonitoringConfiguration[1].operator: 'gte' is not one of gt, gteq, lt, lteq, eq"
    )


# --- runPolicy fields --------------------------------------------------------------------------


def test_every_run_policy_field() -> None:
    rp, ignored = parse_run_policy(
        {
            "jobMaxRetryCount": 0,
            "restartPolicy": {
                "numRestartBeforeFullJobRestart": 2,
                "evalPeriodSeconds": 3600,
                "maxFullJobRestarts": 0,
                "maxNumRepeatOffendersToAvoid": 1,
                "scaleUpSnoozeTimeInSeconds": 0,
            },
            "cleanPodPolicy": "OnlyComplete",
            "faultDeadlineSeconds": 30,
            "startupDeadlineSeconds": 600.5,
            "activeDeadlineSeconds": 86400,
            "ttlSecondsAfterFinished": -1,
            "suspend": False,
            "workloadMode": "Deployment",
            "logMonitoringConfiguration": [],
        },
        where="rp",
    )
    assert rp == RunPolicy(
        job_max_retry_count=0,
        restart_policy=RestartPolicy(
            num_restart_before_full_job_restart=2,
            eval_period_s=3600.0,
            max_full_job_restarts=0,
            max_num_repeat_offenders_to_avoid=1,
            scale_up_snooze_time_s=0.0,
        ),
        startup_deadline_s=600.5,
        fault_deadline_s=30.0,
        active_deadline_s=86400.0,
        log_rules=(),
    )
    assert ignored == [
        "rp.cleanPodPolicy",
        "rp.ttlSecondsAfterFinished",
        "rp.suspend",
        "rp.workloadMode",
    ]
    assert isinstance(rp.startup_deadline_s, float) and isinstance(rp.restart_policy, RestartPolicy)
    assert isinstance(rp.restart_policy.eval_period_s, float)


def test_empty_and_null_fields_are_absent() -> None:
    rp, ignored = parse_run_policy(
        {"jobMaxRetryCount": None, "cleanPodPolicy": None, "logMonitoringConfiguration": None}
    )
    assert rp == RunPolicy()
    assert ignored == []


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"jobMaxRetryCount": -1}, "runPolicy.jobMaxRetryCount: must be at least 0, got -1"),
        ({"jobMaxRetryCount": True}, "runPolicy.jobMaxRetryCount: must be a whole number, got bool True"),
        ({"jobMaxRetryCount": 2.5}, "runPolicy.jobMaxRetryCount: must be a whole number, got float 2.5"),
        ({"jobMaxRetryCount": "3"}, "runPolicy.jobMaxRetryCount: must be a whole number, got str '3'"),
        (
            {"startupDeadlineSeconds": 0},
            "runPolicy.startupDeadlineSeconds: must be more than zero seconds, got 0",
        ),
        ({"faultDeadlineSeconds": -5}, "runPolicy.faultDeadlineSeconds: must be more than zero seconds"),
        ({"activeDeadlineSeconds": float("inf")}, "runPolicy.activeDeadlineSeconds: must be more than zero"),
        (
            {"activeDeadlineSeconds": "1h"},
            "runPolicy.activeDeadlineSeconds: must be a number of seconds, got str",
        ),
        (
            {"startupDeadlineSeconds": False},
            "runPolicy.startupDeadlineSeconds: must be a number of seconds, got bool",
        ),
        (
            {"cleanPodPolicy": "Some"},
            "runPolicy.cleanPodPolicy: 'Some' is not one of All, OnlyComplete, None",
        ),
        ({"ttlSecondsAfterFinished": -2}, "runPolicy.ttlSecondsAfterFinished: must be at least -1"),
        ({"suspend": "yes"}, "runPolicy.suspend: must be true or false, got str 'yes'"),
        ({"workloadMode": 3}, "runPolicy.workloadMode: must be a string"),
        ({"restartPolicy": 3}, "runPolicy.restartPolicy: must be a mapping"),
        (
            {"restartPolicy": {}},
            "runPolicy.restartPolicy.evalPeriodSeconds: is required when restartPolicy is given",
        ),
        (
            {"restartPolicy": {"evalPeriodSeconds": 0}},
            "runPolicy.restartPolicy.evalPeriodSeconds: must be more than zero seconds",
        ),
        (
            {"restartPolicy": {"evalPeriodSeconds": 60, "numRestartBeforeFullJobRestart": -1}},
            "runPolicy.restartPolicy.numRestartBeforeFullJobRestart: must be at least 0",
        ),
        (
            {"restartPolicy": {"evalPeriodSeconds": 60, "maxFullJobRestarts": 1.0}},
            "runPolicy.restartPolicy.maxFullJobRestarts: must be a whole number",
        ),
        (
            {"restartPolicy": {"evalPeriodSeconds": 60, "maxNumRepeatOffendersToAvoid": -1}},
            "runPolicy.restartPolicy.maxNumRepeatOffendersToAvoid: must be at least 0",
        ),
        (
            {"restartPolicy": {"evalPeriodSeconds": 60, "scaleUpSnoozeTimeInSeconds": -1}},
            "runPolicy.restartPolicy.scaleUpSnoozeTimeInSeconds: must be zero or more seconds",
        ),
        (
            {"restartPolicy": {"evalPeriodSecond": 60}},
            "runPolicy.restartPolicy.evalPeriodSecond: unknown field; did you mean 'evalPeriodSeconds'?",
        ),
        ({"jobMaxRetryCnt": 3}, "runPolicy.jobMaxRetryCnt: unknown field; did you mean 'jobMaxRetryCount'?"),
        ({"faultyScanInterval": 3}, "runPolicy.faultyScanInterval: unknown field"),
        (
            {"logMonitoringConfiguration": {"name": "x"}},
            "runPolicy.logMonitoringConfiguration: must be a list",
        ),
        ({"logMonitoringConfiguration": "x"}, "runPolicy.logMonitoringConfiguration: must be a list"),
    ],
)
def test_run_policy_errors(fields: dict[str, Any], match: str) -> None:
    msg = _error(fields)
    assert msg.startswith(match), msg


def test_run_policy_must_be_a_mapping() -> None:
    assert _error(["jobMaxRetryCount"]) == "runPolicy: must be a mapping of fields, got list"


# --- log rules ---------------------------------------------------------------------------------


def test_every_rule_field() -> None:
    rp = _policy(
        logMonitoringConfiguration=[
            {
                "name": "Low_Throughput-1",
                "logPattern": ".*Speed: ([0-9.]+) samples/sec.*",
                "expectedStartCutOffInSeconds": 120,
                "expectedRecurringFrequencyInSeconds": 5.5,
                "stopPattern": ".*Training finished.*",
                "metricThreshold": 80,
                "operator": "lteq",
                "metricEvaluationDataPoints": 25,
                "faultOnMatch": False,
            }
        ]
    )
    (rule,) = rp.log_rules
    assert rule == LogRule(
        name="Low_Throughput-1",
        log_pattern=re.compile(".*Speed: ([0-9.]+) samples/sec.*"),
        expected_start_cutoff_s=120.0,
        expected_recurring_frequency_s=5.5,
        stop_pattern=re.compile(".*Training finished.*"),
        metric_threshold=80.0,
        operator="lteq",
        metric_evaluation_data_points=25,
        fault_on_match=False,
    )
    assert isinstance(rule.metric_threshold, float)


def test_rule_defaults() -> None:
    (rule,) = _policy(logMonitoringConfiguration=[{"name": "x", "logPattern": "a"}]).log_rules
    assert rule == LogRule(name="x", log_pattern=re.compile("a"))
    assert rule.metric_evaluation_data_points == 1 and rule.fault_on_match is False


def test_fractional_threshold_is_kept() -> None:
    (rule,) = _policy(logMonitoringConfiguration=[_rule(metricThreshold=2.0, operator="gt")]).log_rules
    assert rule.metric_threshold == 2.0
    (rule,) = _policy(logMonitoringConfiguration=[_rule(metricThreshold=0.25, operator="gt")]).log_rules
    assert rule.metric_threshold == 0.25


@pytest.mark.parametrize("op", OPERATORS)
def test_every_operator(op: str) -> None:
    (rule,) = _policy(logMonitoringConfiguration=[_rule(metricThreshold=1, operator=op)]).log_rules
    assert rule.operator == op


def test_fault_on_match_rule() -> None:
    (rule,) = _policy(
        logMonitoringConfiguration=[
            {"name": "OOM", "logPattern": ".*RuntimeError.*out of memory.*", "faultOnMatch": True}
        ]
    ).log_rules
    assert rule.fault_on_match is True


P = "runPolicy.logMonitoringConfiguration[0]"


@pytest.mark.parametrize(
    "rule, message",
    [
        ({"logPattern": "x"}, f"{P}.name: is required"),
        ({"name": "x"}, f"{P}.logPattern: is required"),
        ({"name": None, "logPattern": "x"}, f"{P}.name: is required"),
        ({"name": 3, "logPattern": "x"}, f"{P}.name: must be a string, got int 3"),
        (
            {"name": "has space", "logPattern": "x"},
            f"{P}.name: 'has space' may contain only letters, digits, '-' and '_' (it goes into fault reasons)",
        ),
        ({"name": "", "logPattern": "x"}, f"{P}.name: '' may contain only letters"),
        ({"name": "x", "logPattern": 3}, f"{P}.logPattern: must be a string"),
        (
            {"name": "x", "logPattern": ".*(Loss: [0-9.]+"},
            f"{P}.logPattern: '.*(Loss: [0-9.]+' is not a valid regular expression: missing ), unterminated subpattern",
        ),
        (
            {"name": "x", "logPattern": "x", "stopPattern": "[a-"},
            f"{P}.stopPattern: '[a-' is not a valid regular expression: unterminated character set",
        ),
        (
            {"name": "x", "logPattern": "(a)(b)"},
            f"{P}.logPattern: '(a)(b)' has 2 capture groups; at most one may hold the metric",
        ),
        (_rule(metricThreshold=2), f"{P}.operator: is required when metricThreshold is given"),
        (_rule(operator="gt"), f"{P}.metricThreshold: is required when operator is given"),
        (
            _rule(operator="gte", metricThreshold=1),
            f"{P}.operator: 'gte' is not one of gt, gteq, lt, lteq, eq",
        ),
        (_rule(operator=1, metricThreshold=1), f"{P}.operator: must be a string, got int 1"),
        (_rule(operator="gt", metricThreshold="2"), f"{P}.metricThreshold: must be a number, got str '2'"),
        (_rule(operator="gt", metricThreshold=True), f"{P}.metricThreshold: must be a number, got bool"),
        (_rule(operator="gt", metricThreshold=float("nan")), f"{P}.metricThreshold: must be a finite number"),
        (
            {"name": "x", "logPattern": ".*Loss:.*", "operator": "gt", "metricThreshold": 2},
            f"{P}.metricThreshold: needs a capture group in logPattern '.*Loss:.*'",
        ),
        (_rule(metricEvaluationDataPoints=0), f"{P}.metricEvaluationDataPoints: must be at least 1, got 0"),
        (
            _rule(metricEvaluationDataPoints=True),
            f"{P}.metricEvaluationDataPoints: must be a whole number, got bool",
        ),
        (_rule(metricEvaluationDataPoints=2.5), f"{P}.metricEvaluationDataPoints: must be a whole number"),
        (
            _rule(expectedStartCutOffInSeconds=0),
            f"{P}.expectedStartCutOffInSeconds: must be more than zero seconds",
        ),
        (
            _rule(expectedRecurringFrequencyInSeconds=-1),
            f"{P}.expectedRecurringFrequencyInSeconds: must be more than zero seconds",
        ),
        (
            _rule(expectedStartCutOffInSeconds="240"),
            f"{P}.expectedStartCutOffInSeconds: must be a number of seconds",
        ),
        (_rule(faultOnMatch="true"), f"{P}.faultOnMatch: must be true or false, got str 'true'"),
        (_rule(faultOnMatch=1), f"{P}.faultOnMatch: must be true or false, got int 1"),
        (_rule(logPatern="x"), f"{P}.logPatern: unknown field; did you mean 'logPattern'?"),
        (
            _rule(expectedStartCutoffInSeconds=1),
            f"{P}.expectedStartCutoffInSeconds: unknown field; did you mean 'expectedStartCutOffInSeconds'?",
        ),
        ("x", f"{P}: must be a mapping of fields, got str"),
    ],
)
def test_rule_errors(rule: Any, message: str) -> None:
    msg = _error({"logMonitoringConfiguration": [rule]})
    assert msg.startswith(message), msg


def test_duplicate_rule_names() -> None:
    msg = _error({"logMonitoringConfiguration": [_rule(name="a"), _rule(name="b"), _rule(name="a")]})
    assert msg == (
        "runPolicy.logMonitoringConfiguration[2].name: 'a' is already the name of rule [0]; names must be unique"
    )


def test_a_capture_group_without_threshold_is_fine() -> None:
    (rule,) = _policy(logMonitoringConfiguration=[_rule()]).log_rules
    assert rule.log_pattern.groups == 1 and rule.operator is None


def test_non_capturing_groups_do_not_count() -> None:
    (rule,) = _policy(
        logMonitoringConfiguration=[
            _rule(logPattern=r"(?:Batch \d+ )?Loss: ([0-9.]+)", operator="gt", metricThreshold=2)
        ]
    ).log_rules
    assert rule.log_pattern.groups == 1


# --- LogRule built in Python -------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"name": "a b"}, "name: 'a b' may contain only"),
        ({"log_pattern": re.compile("(a)(b)")}, "logPattern: '(a)(b)' has 2 capture groups"),
        ({"operator": "gt"}, "metricThreshold: is required when operator is given"),
        ({"metric_threshold": 1.0}, "operator: is required when metricThreshold is given"),
        ({"metric_threshold": 1.0, "operator": "ge"}, "operator: 'ge' is not one of"),
        ({"metric_threshold": float("inf"), "operator": "gt"}, "metricThreshold: must be a finite number"),
        ({"metric_evaluation_data_points": 0}, "metricEvaluationDataPoints: must be at least 1"),
        ({"expected_start_cutoff_s": 0.0}, "expectedStartCutOffInSeconds: must be a positive number"),
        (
            {"expected_recurring_frequency_s": float("nan")},
            "expectedRecurringFrequencyInSeconds: must be a positive",
        ),
        (
            {"log_pattern": re.compile("x"), "metric_threshold": 1.0, "operator": "gt"},
            "metricThreshold: needs a capture group",
        ),
    ],
)
def test_log_rule_invariants(fields: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {"name": "r", "log_pattern": re.compile("x: ([0-9]+)")}
    with pytest.raises(JobSpecError) as info:
        LogRule(**{**base, **fields})
    assert str(info.value).startswith(message), str(info.value)


def test_values_are_frozen() -> None:
    rule = LogRule(name="r", log_pattern=re.compile("x"))
    with pytest.raises(AttributeError):
        rule.name = "s"  # type: ignore[misc]
    with pytest.raises(TypeError):
        LogRule("r", re.compile("x"))  # type: ignore[call-arg]


def test_parse_does_not_modify_input() -> None:
    document = {
        "logMonitoringConfiguration": [_rule(operator="gt", metricThreshold=1)],
        "jobMaxRetryCount": 1,
    }
    before = copy.deepcopy(document)
    parse_run_policy(document)
    assert document == before
