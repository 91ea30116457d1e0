"""Durable retries and failures in the metrics, from a real S3 server behind the fault proxy."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("prometheus_client")
import tierckpt.metrics as metrics  # noqa: E402
from tests.deploy.test_metrics import scrape, val  # noqa: E402
from tests.s3.faultproxy import Fault  # noqa: E402
from tierckpt import Checkpointer  # noqa: E402
from tierckpt.config import CheckpointConfig, S3Settings  # noqa: E402
from tierckpt.errors import DurableWriteError  # noqa: E402

pytestmark = pytest.mark.s3


def test_s3_retries_and_a_failed_drain_are_scraped(s3_env: Any, bucket: str, proxy: Any, memory_dir: str) -> None:
    metrics.disable()
    metrics.enable(port=0)
    srv = metrics.server()
    assert srv is not None
    settings = S3Settings(endpoint_url=proxy.url, max_attempts=3, retry_deadline_s=10)
    cfg = CheckpointConfig(namespace="s3m", memory_dir=memory_dir, durable_url=f"s3://{bucket}/ck", s3=settings)
    state = {"w": torch.randn(256, 256)}
    ck = Checkpointer(cfg)
    try:
        proxy.add(Fault("slowdown", method="PUT", path="distcp", times=2))
        ck.save(1, state, durable=True).result(60)
        mid, _ = scrape(srv.port)
        proxy.add(Fault("slowdown", method="PUT", path="distcp", times=None))
        with pytest.raises(DurableWriteError, match="after 3 attempt"):
            ck.save(2, {"w": state["w"] + 1}, durable=True).result(60)
        after, _ = scrape(srv.port)
    finally:
        ck.close(raise_errors=False)
        metrics.disable()
    retried = sum(v for (name, _), v in mid.items() if name == "tierckpt_durable_retries_total")
    assert retried == 2
    assert val(mid, "tierckpt_saves_total", namespace="s3m", tier="durable") == 1
    assert val(after, "tierckpt_save_failures_total", namespace="s3m", tier="durable") == 1
    assert sum(v for (name, _), v in after.items() if name == "tierckpt_durable_retries_total") == 4
    assert val(after, "tierckpt_drain_lag_steps", namespace="s3m") == 1  # step 2 only in memory
