"""A synchronous durable save to a throttled S3 is no fault (issue 25): ``tierckpt run`` with the
user's defaults, 2 agents x 1 worker of ``tierckpt.demo.resilient``, every 10th step saved to
``s3://`` and waited for (``--durable-sync``), through a proxy that answers every PUT 1.5 s late and
the first three with ``503 SlowDown`` (tierckpt's retries back off). The saving ranks wait several
seconds without CPU or I/O inside ``Checkpointer.wait`` (waitsample's ``SAVE``), the other rank waits
in its all-reduce for them: no ``Hang`` before the ceiling, no restart, and the durable steps land.

Real SeaweedFS on 127.0.0.1 (the session's server), a real proxy (tests/s3/faultproxy.py), real agents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.launcher.cluster import LocalJob
from tests.launcher.conftest import shm_dirs
from tests.s3.faultproxy import Fault

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 30


@pytest.fixture
def shm() -> Iterator[Callable[[str], str]]:
    with shm_dirs() as make:
        yield make


def test_a_synchronous_save_to_a_throttled_s3_is_no_hang(tmp_path: Path, shm: Callable[[str], str], s3_env: Any,
                                                          bucket: str, proxy: Any, s3_client: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)  # the workers' client goes through the proxy
    proxy.add(Fault("slowdown", method="PUT", times=3))
    proxy.add(Fault("delay", method="PUT", seconds=1.5, times=None))
    job = LocalJob(tmp_path / "job", shm, durable=f"s3://{bucket}/ckpt",
                   train=["--steps", str(STEPS), "--durable-every", "10", "--durable-sync"])
    try:
        job.start()
        assert job.wait_exit(300) == {0: 0, 1: 0}, job.report()
        faults = [e for e in job.events() if e["event"] in ("fault", "restart")]
        assert faults == [], job.report()
        for r in (0, 1):
            waits = {e["step"]: e["wait_s"] for e in job.trace(r) if e["event"] == "durable"}
            assert sorted(waits) == [10, 20, 30], waits
            # each synchronous save waited on the slow S3 longer than the 5 s idle limit at least once
            assert max(waits.values()) >= 5.0, waits
            assert {e["generation"] for e in job.trace(r)} == {0}
        assert any(e[2] == "503" for e in proxy.log) and any(e[2] == "delay" for e in proxy.log), proxy.log[:5]
        keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix="ckpt/").get("Contents", [])]
        assert any("/step_30/" in k for k in keys), keys[:20]
    finally:
        job.close()
