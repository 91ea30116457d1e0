"""Metrics scraped over loopback and parsed by prometheus_client's own parser.

Real parts: a real Checkpointer on a tmpfs memory tier and a file:// durable tier, the real
HTTP endpoint on 127.0.0.1 (each test closes it), the launcher's and the agent's registries.
"""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import tierckpt.metrics as metrics  # noqa: E402
from tierckpt import CheckpointConfig, Checkpointer  # noqa: E402
from tierckpt.agent.metrics import AgentMetrics  # noqa: E402
from tierckpt.launcher.events import Events  # noqa: E402
from tierckpt.tiers.s3_retry import Retrier  # noqa: E402

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> tuple[Samples, dict[str, str]]:
    """GET /metrics; every sample by (name, labels), and each family's type."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples: Samples = {}
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, types


def val(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


@pytest.fixture
def lib() -> Iterator[int]:
    """The library's metrics on a free loopback port; off again afterwards."""
    metrics.disable()
    metrics.enable(port=0)
    srv = metrics.server()
    assert srv is not None
    yield srv.port
    metrics.disable()


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}


def test_registry_types_values_and_histogram_buckets() -> None:
    reg = metrics.Registry()
    c = reg.counter("t_requests_total", "requests", ("code",))
    g = reg.gauge("t_temperature_celsius", "temperature")
    h = reg.histogram("t_latency_seconds", "latency", ("op",), buckets=(0.1, 1.0))
    c.inc(code="200")
    c.inc(2, code="200")
    g.set(-3.5)
    for v in (0.05, 0.1, 0.5, 7.0):
        h.observe(v, op="get")
    with pytest.raises(ValueError, match="only goes up"):
        c.inc(-1, code="200")
    with pytest.raises(ValueError, match="takes labels"):
        c.inc(color="red")
    srv = metrics.serve(reg, 0)
    try:
        samples, types = scrape(srv.port)
    finally:
        srv.close()
    assert types["t_requests"] == "counter" and types["t_latency_seconds"] == "histogram"
    assert val(samples, "t_requests_total", code="200") == 3
    assert val(samples, "t_temperature_celsius") == -3.5
    # cumulative buckets: le is inclusive (0.1 falls in the 0.1 bucket)
    assert val(samples, "t_latency_seconds_bucket", op="get", le="0.1") == 2
    assert val(samples, "t_latency_seconds_bucket", op="get", le="1.0") == 3
    assert val(samples, "t_latency_seconds_bucket", op="get", le="+Inf") == 4
    assert val(samples, "t_latency_seconds_count", op="get") == 4
    assert val(samples, "t_latency_seconds_sum", op="get") == pytest.approx(7.65)
    assert val(samples, "process_resident_memory_bytes") is not None  # prometheus_client's process collector
    assert h.count(op="get") == 4 and c.value(code="200") == 3


def test_off_by_default_hooks_record_nothing(shm_root: Path) -> None:
    metrics.disable()
    cfg = CheckpointConfig(namespace="off", memory_dir=str(shm_root))
    with Checkpointer(cfg) as ck:
        ck.save(1, _state(1)).result()
    assert metrics.library_metrics() is None and metrics.server() is None


def test_save_drain_and_load_change_the_scraped_values(lib: int, shm_root: Path, durable_dir: Path) -> None:
    cfg = CheckpointConfig(namespace="m", memory_dir=str(shm_root), durable_url=f"file://{durable_dir}",
                           durable_every_n_steps=2)
    before, types = scrape(lib)
    assert val(before, "tierckpt_save_blocking_seconds_count", namespace="m") is None
    assert types["tierckpt_save_blocking_seconds"] == "histogram"
    nbytes = sum(t.numel() * t.element_size() for t in _state(0).values())
    with Checkpointer(cfg) as ck:
        ck.save(1, _state(1)).memory_committed()  # memory only (durable every 2 steps)
        mid, _ = scrape(lib)
        assert val(mid, "tierckpt_save_blocking_seconds_count", namespace="m") == 1
        assert val(mid, "tierckpt_saves_total", namespace="m", tier="memory") == 1
        assert val(mid, "tierckpt_save_commit_seconds_count", namespace="m", tier="memory") == 1
        assert val(mid, "tierckpt_last_committed_step", namespace="m", tier="memory") == 1
        assert val(mid, "tierckpt_save_bytes_total", namespace="m", tier="memory") >= nbytes  # type: ignore[operator]
        assert val(mid, "tierckpt_drain_lag_steps", namespace="m") == 0  # one memory step, nothing durable yet
        assert val(mid, "tierckpt_drain_lag_seconds", namespace="m") > 0  # type: ignore[operator]
        ck.save(2, _state(2)).result()  # durable
        ck.save(3, _state(3)).memory_committed()
        after, _ = scrape(lib)
        assert val(after, "tierckpt_saves_total", namespace="m", tier="memory") == 3
        assert val(after, "tierckpt_saves_total", namespace="m", tier="durable") == 1
        assert val(after, "tierckpt_last_committed_step", namespace="m", tier="durable") == 2
        assert val(after, "tierckpt_save_bytes_total", namespace="m", tier="durable") >= nbytes  # type: ignore[operator]
        assert val(after, "tierckpt_drain_lag_steps", namespace="m") == 1  # step 3 in memory, 2 durable
        ck.wait()
        target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        assert ck.load(target) == 3
    assert torch.equal(target["w"], _state(3)["w"])
    loaded, _ = scrape(lib)
    assert val(loaded, "tierckpt_loads_total", namespace="m", tier="memory") == 1
    assert val(loaded, "tierckpt_load_seconds_count", namespace="m", tier="memory") == 1
    assert val(loaded, "tierckpt_last_loaded_step", namespace="m") == 3
    assert val(loaded, "tierckpt_save_failures_total", namespace="m", tier="durable") is None


def test_a_failed_drain_is_counted(lib: int, shm_root: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the durable root should be")
    cfg = CheckpointConfig(namespace="f", memory_dir=str(shm_root), durable_url=f"file://{blocker}")
    with Checkpointer(cfg) as ck:
        handle = ck.save(1, _state(1), durable=True)
        with pytest.raises(Exception, match="durable"):
            handle.result()
        ck.close(raise_errors=False)
    samples, _ = scrape(lib)
    assert val(samples, "tierckpt_save_failures_total", namespace="f", tier="durable") == 1
    assert val(samples, "tierckpt_saves_total", namespace="f", tier="memory") == 1
    assert val(samples, "tierckpt_drain_lag_steps", namespace="f") == 0
    assert val(samples, "tierckpt_drain_lag_seconds", namespace="f") > 0  # type: ignore[operator]


def test_durable_retries_are_counted(lib: int) -> None:
    """The real Retrier: one transient failure, then success (its sleep is skipped, not mocked away
    from the logic: the wait is computed and passed)."""
    calls: list[float] = []
    attempts = iter([ConnectionError("reset by peer"), None])

    def flaky() -> str:
        err = next(attempts)
        if err is not None:
            raise err
        return "ok"

    r = Retrier(bucket="b", endpoint="http://127.0.0.1:1", max_attempts=3, deadline_s=10, sleep=calls.append)
    assert r.call(flaky, what="put", key="k") == "ok"
    samples, _ = scrape(lib)
    assert val(samples, "tierckpt_durable_retries_total", operation="put") == 1 and len(calls) == 1


def _free_port_pair() -> int:
    """A base port P such that P + 1 is free now (the test serves on P + LOCAL_RANK)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1]) - 1


def test_env_var_serves_on_port_plus_local_rank(monkeypatch: pytest.MonkeyPatch, shm_root: Path) -> None:
    metrics.disable()
    base = _free_port_pair()
    monkeypatch.setenv("TIERCKPT_METRICS_PORT", str(base))
    monkeypatch.setenv("LOCAL_RANK", "1")
    try:
        with Checkpointer(CheckpointConfig(namespace="env", memory_dir=str(shm_root))) as ck:
            ck.save(5, _state(5)).memory_committed()
            srv = metrics.server()
            assert srv is not None and srv.port == base + 1
            samples, _ = scrape(base + 1)
        assert val(samples, "tierckpt_last_committed_step", namespace="env", tier="memory") == 5
    finally:
        metrics.disable()


def test_bad_env_port_leaves_metrics_off(monkeypatch: pytest.MonkeyPatch) -> None:
    metrics.disable()
    monkeypatch.setenv("TIERCKPT_METRICS_PORT", "not-a-port")
    metrics.enable_from_env()
    assert metrics.library_metrics() is None


def test_launcher_and_agent_metrics_are_served_the_same_way() -> None:
    ev = Events(path=None, node=0, metrics_port=0)
    try:
        ev.emit("fault", generation=2, reason="Crash", rank=1)
        ev.emit("restart", generation=3, kind="process")
        assert ev.server is not None
        samples, types = scrape(ev.server.port)
    finally:
        ev.close()
    assert val(samples, "tierckpt_run_faults_total", reason="Crash") == 1
    assert val(samples, "tierckpt_run_restarts_total", kind="process") == 1
    assert val(samples, "tierckpt_run_generation") == 3 and types["tierckpt_run_faults"] == "counter"
    agent = AgentMetrics()
    agent.evictions.inc(kind="replica")
    srv = metrics.serve(agent.registry, 0)
    try:
        samples, _ = scrape(srv.port)
    finally:
        srv.close()
    assert val(samples, "tierckpt_agent_evictions_total", kind="replica") == 1


def test_the_bind_address_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """TIERCKPT_METRICS_HOST moves every endpoint (library, run, agent) at once; here to 127.0.0.2."""
    monkeypatch.setenv("TIERCKPT_METRICS_HOST", "127.0.0.2")
    reg = metrics.Registry()
    reg.gauge("t_up", "up").set(1)
    srv = metrics.serve(reg, 0)
    try:
        assert srv.host == "127.0.0.2"
        with urllib.request.urlopen(f"http://127.0.0.2:{srv.port}/metrics", timeout=10) as resp:
            assert "t_up 1.0" in resp.read().decode()
    finally:
        srv.close()
