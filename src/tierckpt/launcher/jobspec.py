"""The job file: a HyperPodPyTorchJob (or just its ``runPolicy``) parsed into frozen values.

Call order: the launcher's shell calls ``load_job_file(path)`` once at start (or ``parse_job``
on a mapping it already holds), warns once about ``JobFile.ignored_fields``, and hands
``JobFile.run_policy`` to the rule monitor and the escalation policy. Nothing here does I/O
except reading that one file.

Field names and meanings follow the HyperPod training operator's CRD (camelCase in the file,
snake_case here). Fields the CRD defines but this launcher does not use are accepted and
listed in ``ignored_fields``; unknown or mistyped fields are errors that name the field path
and, for a near miss, the right name.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierckpt.errors import ConfigError

__all__ = [
    "OPERATORS",
    "ElasticPolicy",
    "JobFile",
    "JobSpecError",
    "LogRule",
    "RestartPolicy",
    "RunPolicy",
    "load_job_file",
    "parse_job",
    "parse_run_policy",
]

OPERATORS = ("gt", "gteq", "lt", "lteq", "eq")
JOB_KIND = "HyperPodPyTorchJob"
_RULE_NAME = re.compile(r"[A-Za-z0-9_-]+")
_CLEAN_POD_POLICIES = ("All", "OnlyComplete", "None")


class JobSpecError(ConfigError):
    """The job file is invalid; the message starts with the field path, e.g.
    ``spec.runPolicy.logMonitoringConfiguration[1].operator: ...``."""


def _fail(where: str, problem: str) -> JobSpecError:
    return JobSpecError(f"{where}: {problem}")


@dataclass(frozen=True, kw_only=True)
class LogRule:
    """One ``logMonitoringConfiguration`` entry. Invariants are checked here, so a rule built
    in Python is as valid as one parsed from a file; messages use the file's camelCase names."""

    name: str
    log_pattern: re.Pattern[str]
    expected_start_cutoff_s: float | None = None
    expected_recurring_frequency_s: float | None = None
    stop_pattern: re.Pattern[str] | None = None
    metric_threshold: float | None = None
    operator: str | None = None
    metric_evaluation_data_points: int = 1
    fault_on_match: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _RULE_NAME.fullmatch(self.name):
            raise _fail(
                "name",
                f"{self.name!r} may contain only letters, digits, '-' and '_' (it goes into fault reasons)",
            )
        if self.log_pattern.groups > 1:
            raise _fail(
                "logPattern",
                f"{self.log_pattern.pattern!r} has {self.log_pattern.groups} capture groups; at most one "
                "may hold the metric, make the others non-capturing with (?:...)",
            )
        for field, value in (
            ("expectedStartCutOffInSeconds", self.expected_start_cutoff_s),
            ("expectedRecurringFrequencyInSeconds", self.expected_recurring_frequency_s),
        ):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise _fail(field, f"must be a positive number of seconds, got {value!r}")
        if (self.metric_threshold is None) != (self.operator is None):
            given, missing = (
                ("metricThreshold", "operator") if self.operator is None else ("operator", "metricThreshold")
            )
            raise _fail(missing, f"is required when {given} is given; threshold and operator come together")
        if self.operator is not None and self.operator not in OPERATORS:
            raise _fail("operator", f"{self.operator!r} is not one of {', '.join(OPERATORS)}")
        if self.metric_threshold is not None:
            if not math.isfinite(self.metric_threshold):
                raise _fail("metricThreshold", f"must be a finite number, got {self.metric_threshold!r}")
            if self.log_pattern.groups != 1:
                raise _fail(
                    "metricThreshold",
                    f"needs a capture group in logPattern {self.log_pattern.pattern!r} to compare with, "
                    "e.g. '.*Loss: ([0-9.]+).*'",
                )
        if self.metric_evaluation_data_points < 1:
            raise _fail(
                "metricEvaluationDataPoints", f"must be at least 1, got {self.metric_evaluation_data_points}"
            )


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    """``runPolicy.restartPolicy``: when process restarts escalate to a full job restart."""

    num_restart_before_full_job_restart: int | None = None
    eval_period_s: float | None = None
    max_full_job_restarts: int | None = None
    max_num_repeat_offenders_to_avoid: int | None = None  # offenders.py / avoid.py
    scale_up_snooze_time_s: float | None = None  # snooze.py


@dataclass(frozen=True, kw_only=True)
class RunPolicy:
    """``runPolicy``: retry limits, deadlines and log rules for one job."""

    job_max_retry_count: int | None = None
    restart_policy: RestartPolicy | None = None
    startup_deadline_s: float | None = None
    fault_deadline_s: float | None = None
    active_deadline_s: float | None = None
    log_rules: tuple[LogRule, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ElasticPolicy:
    """``spec.elasticPolicy`` (and ``replicaSpecs[0].maxReplicas``): the node counts the job may run on.

    ``allowed`` is every node count from ``min_nodes`` to ``max_nodes`` that ``replicaDiscreteValues``
    lists, or that ``replicaIncrementStep`` reaches from ``min_nodes`` (every count without either);
    a job never settles on another (docs/launcher.md, "Elastic membership"). The three timeouts:
    ``scaling_timeout_s`` the rendezvous' last call, ``graceful_shutdown_timeout_s`` the workers'
    SIGTERM grace, ``faulty_scale_down_timeout_s`` the wait for a replacement before a shrink
    (launcher/cli.py ``_elastic_timeouts``), each where the command line set nothing."""

    min_nodes: int
    max_nodes: int
    allowed: tuple[int, ...]
    increment_step: int | None = None
    discrete_values: tuple[int, ...] | None = None
    scaling_timeout_s: float | None = None
    graceful_shutdown_timeout_s: float | None = None
    faulty_scale_down_timeout_s: float | None = None

    def __post_init__(self) -> None:
        where = "spec.elasticPolicy"
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise _fail(f"{where}.maxReplicas", f"must be at least minReplicas ({self.min_nodes}), got {self.max_nodes}")
        if not self.allowed or list(self.allowed) != sorted(set(self.allowed)) or \
                self.allowed[0] != self.min_nodes or self.allowed[-1] > self.max_nodes:
            raise _fail(where, f"the allowed node counts {list(self.allowed)} must be ascending, start at minReplicas "
                        f"({self.min_nodes}) and stay within maxReplicas ({self.max_nodes})")


@dataclass(frozen=True)
class JobFile:
    """A parsed job file: the run policy, and the dotted paths of fields accepted but unused."""

    run_policy: RunPolicy
    ignored_fields: tuple[str, ...]
    #: ``spec.elasticPolicy`` (minReplicas, maxReplicas): the job's nodes, as ``--nnodes MIN:MAX``
    elastic: tuple[int, int] | None = None
    #: the whole ``spec.elasticPolicy`` (the allowed node counts, the timeouts)
    elastic_policy: ElasticPolicy | None = None


# --- field readers: each names the field path in its error -------------------------------------


def _check_keys(mapping: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    known = tuple(known)
    for key in mapping:
        if key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else f"known fields: {', '.join(known)}"
            raise _fail(f"{where}.{key}", f"unknown field; {fix}")


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(where, f"must be a mapping of fields, got {type(value).__name__}")
    return value


def _int(value: Any, where: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(where, f"must be a whole number, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise _fail(where, f"must be at least {minimum}, got {value}")
    return value


def _seconds(value: Any, where: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(where, f"must be a number of seconds, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "more than zero"
        raise _fail(where, f"must be {bound} seconds, got {value!r}")
    return float(value)


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(where, f"must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise _fail(where, f"must be a finite number, got {value!r}")
    return float(value)


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _fail(where, f"must be a string, got {type(value).__name__} {value!r}")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, f"must be true or false, got {type(value).__name__} {value!r}")
    return value


def _regex(value: Any, where: str) -> re.Pattern[str]:
    text = _str(value, where)
    try:
        return re.compile(text)
    except re.error as exc:
        raise _fail(where, f"{text!r} is not a valid regular expression: {exc}") from None


def _present(mapping: Mapping[str, Any], key: str) -> bool:
    """A key set to null counts as absent, as in Kubernetes."""
    return mapping.get(key) is not None


# --- runPolicy ---------------------------------------------------------------------------------

_RULE_FIELDS = (
    "name",
    "logPattern",
    "expectedStartCutOffInSeconds",
    "expectedRecurringFrequencyInSeconds",
    "stopPattern",
    "metricThreshold",
    "operator",
    "metricEvaluationDataPoints",
    "faultOnMatch",
)
_RESTART_FIELDS = (
    "numRestartBeforeFullJobRestart",
    "evalPeriodSeconds",
    "maxFullJobRestarts",
    "maxNumRepeatOffendersToAvoid",
    "scaleUpSnoozeTimeInSeconds",
)
_RUN_POLICY_FIELDS = (
    "jobMaxRetryCount",
    "restartPolicy",
    "cleanPodPolicy",
    "faultDeadlineSeconds",
    "startupDeadlineSeconds",
    "activeDeadlineSeconds",
    "ttlSecondsAfterFinished",
    "suspend",
    "workloadMode",
    "logMonitoringConfiguration",
)


def _parse_rule(raw: Any, where: str) -> LogRule:
    m = _mapping(raw, where)
    _check_keys(m, _RULE_FIELDS, where)
    for required in ("name", "logPattern"):
        if not _present(m, required):
            raise _fail(f"{where}.{required}", "is required")
    fields: dict[str, Any] = {
        "name": _str(m["name"], f"{where}.name"),
        "log_pattern": _regex(m["logPattern"], f"{where}.logPattern"),
    }
    readers: tuple[tuple[str, str, Any], ...] = (
        ("expectedStartCutOffInSeconds", "expected_start_cutoff_s", _seconds),
        ("expectedRecurringFrequencyInSeconds", "expected_recurring_frequency_s", _seconds),
        ("stopPattern", "stop_pattern", _regex),
        ("metricThreshold", "metric_threshold", _number),
        ("operator", "operator", _str),
        ("metricEvaluationDataPoints", "metric_evaluation_data_points", lambda v, w: _int(v, w, minimum=1)),
        ("faultOnMatch", "fault_on_match", _bool),
    )
    for key, attr, read in readers:
        if _present(m, key):
            fields[attr] = read(m[key], f"{where}.{key}")
    try:
        return LogRule(**fields)
    except JobSpecError as exc:  # a cross-field invariant; LogRule names the field, we add the path
        raise JobSpecError(f"{where}.{exc.message}") from None


def _parse_rules(raw: Any, where: str) -> tuple[LogRule, ...]:
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        raise _fail(where, f"must be a list of rules, got {type(raw).__name__}")
    rules: list[LogRule] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(raw):
        rule = _parse_rule(item, f"{where}[{i}]")
        if rule.name in seen:
            raise _fail(
                f"{where}[{i}].name",
                f"{rule.name!r} is already the name of rule [{seen[rule.name]}]; names must be unique",
            )
        seen[rule.name] = i
        rules.append(rule)
    return tuple(rules)


def _parse_restart_policy(raw: Any, where: str, ignored: list[str]) -> RestartPolicy:
    m = _mapping(raw, where)
    _check_keys(m, _RESTART_FIELDS, where)
    if not _present(m, "evalPeriodSeconds"):
        raise _fail(
            f"{where}.evalPeriodSeconds",
            "is required when restartPolicy is given, e.g. evalPeriodSeconds: 3600",
        )
    counts = {
        key: _int(m[key], f"{where}.{key}", minimum=0)
        for key in ("numRestartBeforeFullJobRestart", "maxFullJobRestarts", "maxNumRepeatOffendersToAvoid")
        if _present(m, key)
    }
    snooze = None
    if _present(m, "scaleUpSnoozeTimeInSeconds"):
        snooze = _seconds(
            m["scaleUpSnoozeTimeInSeconds"], f"{where}.scaleUpSnoozeTimeInSeconds", allow_zero=True
        )
    return RestartPolicy(
        num_restart_before_full_job_restart=counts.get("numRestartBeforeFullJobRestart"),
        eval_period_s=_seconds(m["evalPeriodSeconds"], f"{where}.evalPeriodSeconds"),
        max_full_job_restarts=counts.get("maxFullJobRestarts"),
        max_num_repeat_offenders_to_avoid=counts.get("maxNumRepeatOffendersToAvoid"),
        scale_up_snooze_time_s=snooze,
    )


def _check_unused(m: Mapping[str, Any], where: str, ignored: list[str]) -> None:
    """Type-check the CRD fields this launcher accepts but does not act on."""
    if _present(m, "cleanPodPolicy") and m["cleanPodPolicy"] not in _CLEAN_POD_POLICIES:
        raise _fail(
            f"{where}.cleanPodPolicy",
            f"{m['cleanPodPolicy']!r} is not one of {', '.join(_CLEAN_POD_POLICIES)}",
        )
    if _present(m, "ttlSecondsAfterFinished"):
        _int(m["ttlSecondsAfterFinished"], f"{where}.ttlSecondsAfterFinished", minimum=-1)
    if _present(m, "suspend"):
        _bool(m["suspend"], f"{where}.suspend")
    if _present(m, "workloadMode"):
        _str(m["workloadMode"], f"{where}.workloadMode")
    ignored.extend(
        f"{where}.{key}"
        for key in ("cleanPodPolicy", "ttlSecondsAfterFinished", "suspend", "workloadMode")
        if _present(m, key)
    )


def parse_run_policy(mapping: Mapping[str, Any], *, where: str = "runPolicy") -> tuple[RunPolicy, list[str]]:
    """Parse a ``runPolicy`` mapping; returns the policy and the dotted paths of ignored fields.

    ``where`` prefixes every field path in errors and in the ignored list.
    """
    m = _mapping(mapping, where)
    _check_keys(m, _RUN_POLICY_FIELDS, where)
    ignored: list[str] = []
    _check_unused(m, where, ignored)
    deadlines = {
        key: _seconds(m[key], f"{where}.{key}")
        for key in ("startupDeadlineSeconds", "faultDeadlineSeconds", "activeDeadlineSeconds")
        if _present(m, key)
    }
    policy = RunPolicy(
        job_max_retry_count=None
        if not _present(m, "jobMaxRetryCount")
        else _int(m["jobMaxRetryCount"], f"{where}.jobMaxRetryCount", minimum=0),
        restart_policy=None
        if not _present(m, "restartPolicy")
        else _parse_restart_policy(m["restartPolicy"], f"{where}.restartPolicy", ignored),
        startup_deadline_s=deadlines.get("startupDeadlineSeconds"),
        fault_deadline_s=deadlines.get("faultDeadlineSeconds"),
        active_deadline_s=deadlines.get("activeDeadlineSeconds"),
        log_rules=()
        if not _present(m, "logMonitoringConfiguration")
        else _parse_rules(m["logMonitoringConfiguration"], f"{where}.logMonitoringConfiguration"),
    )
    return policy, ignored


# --- whole documents ---------------------------------------------------------------------------

_JOB_FIELDS = ("apiVersion", "kind", "metadata", "spec", "status")
_SPEC_FIELDS = ("nprocPerNode", "replicaSpecs", "runPolicy", "elasticPolicy")


def parse_job(document: Mapping[str, Any]) -> JobFile:
    """Parse a full HyperPodPyTorchJob (it has ``spec`` or ``kind``) or a bare runPolicy mapping.

    Of a full job ``spec.runPolicy`` and ``spec.elasticPolicy``'s minReplicas/maxReplicas are used;
    ``metadata``, ``status``, ``spec.nprocPerNode`` and ``spec.replicaSpecs`` are accepted and
    listed as ignored.
    """
    doc = _mapping(document, "job file")
    if "spec" not in doc and "kind" not in doc:
        policy, ignored = parse_run_policy(doc, where="runPolicy")
        return JobFile(policy, tuple(ignored))
    _check_keys(doc, _JOB_FIELDS, "job")
    if _present(doc, "kind") and doc["kind"] != JOB_KIND:
        raise _fail("kind", f"{doc['kind']!r} is not supported; the launcher reads kind: {JOB_KIND}")
    if _present(doc, "apiVersion"):
        _str(doc["apiVersion"], "apiVersion")
    ignored = [key for key in ("metadata", "status") if key in doc]
    spec = _mapping({} if doc.get("spec") is None else doc["spec"], "spec")
    _check_keys(spec, _SPEC_FIELDS, "spec")
    ignored.extend(f"spec.{key}" for key in ("nprocPerNode", "replicaSpecs") if key in spec)
    cap = _replica_max(spec.get("replicaSpecs"))
    el = _parse_elastic(spec["elasticPolicy"], ignored, cap) if _present(spec, "elasticPolicy") else None
    elastic = (el.min_nodes, el.max_nodes) if el is not None else None
    if not _present(spec, "runPolicy"):
        return JobFile(RunPolicy(), tuple(ignored), elastic, el)
    policy, more = parse_run_policy(spec["runPolicy"], where="spec.runPolicy")
    return JobFile(policy, tuple(ignored + more), elastic, el)


def _replica_max(raw: Any) -> int | None:
    """``replicaSpecs[0].maxReplicas`` (the pods that replica group may grow to), or None."""
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], Mapping) or not _present(raw[0], "maxReplicas"):
        return None
    return _int(raw[0]["maxReplicas"], "spec.replicaSpecs[0].maxReplicas", minimum=1)


_ELASTIC_USED = ("minReplicas", "maxReplicas", "replicaIncrementStep", "replicaDiscreteValues",
                 "scalingTimeoutInSeconds", "gracefulShutdownTimeoutInSeconds", "faultyScaleDownTimeoutInSeconds")


def _parse_elastic(raw: Any, ignored: list[str], replica_max: int | None) -> ElasticPolicy | None:
    """``spec.elasticPolicy``: ``minReplicas``/``maxReplicas`` become ``--nnodes MIN:MAX`` (one given:
    both the same; ``replicaSpecs[0].maxReplicas`` is MAX when the policy names none, and may not
    differ from it); ``replicaDiscreteValues`` or ``replicaIncrementStep`` (not both) narrow the node
    counts; the timeouts are checked and acted on (``ElasticPolicy``); its other fields (Kubeflow's
    rendezvous settings) are listed as ignored."""
    where = "spec.elasticPolicy"
    m = _mapping(raw, where)
    ignored.extend(f"{where}.{k}" for k in m if k not in _ELASTIC_USED)
    lo = _int(m["minReplicas"], f"{where}.minReplicas", minimum=1) if _present(m, "minReplicas") else None
    hi = _int(m["maxReplicas"], f"{where}.maxReplicas", minimum=1) if _present(m, "maxReplicas") else None
    if hi is not None and replica_max is not None and hi != replica_max:
        raise _fail("spec.replicaSpecs[0].maxReplicas", f"{replica_max} differs from {where}.maxReplicas ({hi}); "
                    "give one value, or drop one of them")
    hi = hi if hi is not None else replica_max
    if lo is None and hi is None:
        return None
    lo, hi = (lo if lo is not None else hi), (hi if hi is not None else lo)
    if lo is None or hi is None or hi < lo:
        raise _fail(f"{where}.maxReplicas", f"must be at least minReplicas ({lo}), got {hi}")
    step = _int(m["replicaIncrementStep"], f"{where}.replicaIncrementStep", minimum=1) \
        if _present(m, "replicaIncrementStep") else None
    values = _discrete(m["replicaDiscreteValues"], f"{where}.replicaDiscreteValues", lo, hi) \
        if _present(m, "replicaDiscreteValues") else None
    if step is not None and values is not None:
        raise _fail(where, "replicaIncrementStep and replicaDiscreteValues exclude each other; keep one")
    allowed = values if values is not None else tuple(range(lo, hi + 1, step or 1))
    timeouts = {k: _seconds(m[k], f"{where}.{k}", allow_zero=True) if _present(m, k) else None
                for k in _ELASTIC_USED[4:]}
    return ElasticPolicy(min_nodes=lo, max_nodes=hi, allowed=allowed, increment_step=step, discrete_values=values,
                         scaling_timeout_s=timeouts["scalingTimeoutInSeconds"],
                         graceful_shutdown_timeout_s=timeouts["gracefulShutdownTimeoutInSeconds"],
                         faulty_scale_down_timeout_s=timeouts["faultyScaleDownTimeoutInSeconds"])


def _discrete(raw: Any, where: str, lo: int, hi: int) -> tuple[int, ...]:
    """``replicaDiscreteValues``: distinct node counts from minReplicas to maxReplicas, minReplicas among them."""
    if not isinstance(raw, list) or not raw:
        raise _fail(where, f"must be a non-empty list of node counts, e.g. [{lo}, {hi}]; got {raw!r}")
    values = [_int(v, f"{where}[{i}]", minimum=1) for i, v in enumerate(raw)]
    if len(set(values)) != len(values):
        raise _fail(where, f"{values} lists a node count twice; list each once")
    outside = [v for v in values if not lo <= v <= hi]
    if outside:
        raise _fail(where, f"{outside} outside minReplicas..maxReplicas ({lo}..{hi}); every allowed count must "
                    "lie in that range")
    if lo not in values:
        raise _fail(where, f"{sorted(values)} leaves out minReplicas ({lo}): the job could never run on its "
                    "minimum; add it, or raise minReplicas")
    return tuple(sorted(values))


def load_job_file(path: str | os.PathLike[str]) -> JobFile:
    """Read and parse a job file: JSON when it ends in ``.json``, else YAML (one or more documents;
    with several, the one whose kind is HyperPodPyTorchJob is used)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise JobSpecError(
            f"cannot read job file {p}: {exc}; check the path given to --job", path=str(p)
        ) from exc
    if p.suffix.lower() == ".json":
        try:
            documents = [json.loads(text)]
        except json.JSONDecodeError as exc:
            raise JobSpecError(f"{p}: not valid JSON: {exc}", path=str(p)) from None
    else:
        documents = _load_yaml(text, p)
    documents = [d for d in documents if d is not None]
    if not documents:
        raise JobSpecError(
            f"{p}: the file holds no document; write a HyperPodPyTorchJob or a runPolicy mapping", path=str(p)
        )
    if len(documents) > 1:
        jobs = [d for d in documents if isinstance(d, Mapping) and d.get("kind") == JOB_KIND]
        if len(jobs) != 1:
            raise JobSpecError(
                f"{p}: {len(documents)} YAML documents and {len(jobs)} of kind {JOB_KIND}; keep exactly one job per file",
                path=str(p),
            )
        documents = jobs
    try:
        return parse_job(documents[0])
    except JobSpecError as exc:
        raise JobSpecError(f"{p}: {exc.message}", path=str(p)) from None


def _load_yaml(text: str, path: Path) -> list[Any]:
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml is a dependency
        raise JobSpecError(
            "reading a YAML job file needs PyYAML: pip install 'pyyaml>=6'", path=str(path)
        ) from None
    try:
        return list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise JobSpecError(f"{path}: not valid YAML: {exc}", path=str(path)) from None
