"""The Grafana dashboard references only metrics that tierckpt exports, and shows the key figures."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tierckpt.agent.metrics import AgentMetrics
from tierckpt.launcher.events import Events
from tierckpt.metrics import LibraryMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tierckpt.json"
_HISTOGRAM_SERIES = re.compile(r"_(bucket|sum|count)$")


def exported_series() -> set[str]:
    """Every series name a scrape of the library, tierckpt run or tierckpt agent can return."""
    events = Events(path=None, node=0)
    try:
        regs = [LibraryMetrics().registry, events.registry, AgentMetrics().registry]
    finally:
        events.close()
    names: set[str] = set()
    for reg in regs:
        for fam in reg._metrics.values():
            if fam.kind == "histogram":
                names.update(f"{fam.name}_{s}" for s in ("bucket", "sum", "count"))
            else:
                names.add(fam.name)
    return names


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return exprs


def test_every_metric_in_the_dashboard_exists() -> None:
    exported = exported_series()
    used = {m for e in dashboard_exprs() for m in re.findall(r"\btierckpt_[a-z0-9_]+", e)}
    assert used, "the dashboard queries no tierckpt metric"
    assert used <= exported, f"not exported: {sorted(used - exported)}"


def test_the_key_figures_have_panels() -> None:
    used = {_HISTOGRAM_SERIES.sub("", m) for e in dashboard_exprs() for m in re.findall(r"\btierckpt_[a-z0-9_]+", e)}
    for key in ("tierckpt_save_blocking_seconds", "tierckpt_save_commit_seconds", "tierckpt_save_bytes_total",
                "tierckpt_drain_lag_steps", "tierckpt_drain_lag_seconds", "tierckpt_save_failures_total",
                "tierckpt_durable_retries_total", "tierckpt_load_seconds", "tierckpt_loads_total",
                "tierckpt_run_faults_total", "tierckpt_run_restarts_total", "tierckpt_agent_held_bytes",
                # the HyperPod operator's job counters and latency histograms (issue 28 item 5)
                "tierckpt_run_jobs_started_total", "tierckpt_run_jobs_ended_total",
                "tierckpt_run_detection_latency_seconds", "tierckpt_run_recovery_seconds",
                "tierckpt_run_downtime_seconds", "tierckpt_run_downtime_seconds_total"):
        assert key in used, key


def test_panels_are_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}" and t["refId"]
