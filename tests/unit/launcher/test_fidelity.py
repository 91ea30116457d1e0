"""hyperpodrun's parts and the operator's metrics (issue 28 items 3 and 5), on real parts: the
agent API over real HTTP, scripts as real processes, the metrics scraped from their endpoint,
the namespace log as a real file; the command line through ``tierckpt run``'s own parser."""

from __future__ import annotations

import json
import logging
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_metrics import scrape, val
from tierckpt.errors import ConfigError, TierckptError, TrainScriptError
from tierckpt.launcher.agentapi import AgentApi, AgentStatus, ApiSettings
from tierckpt.launcher.events import Events
from tierckpt.launcher.workers.hooks import TrainScripts
from tierckpt.observability import SEED_LOG_DIR, namespace_log


def _get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_api_follows_the_events_over_http() -> None:
    ev = Events(path=None, node=None)
    status = AgentStatus()
    ev.listen(status.on_event)
    api = AgentApi.start(ApiSettings(port=0), status)
    assert api is not None
    port = api.address[1]
    try:
        assert _get(port, "/status")[1]["state"] == "INIT"
        ev.node = 1
        ev.emit("started", generation=0, nnodes=2, world_size=4, pids=[1, 2])
        assert _get(port, "/health") == (200, {"healthy": True, "state": "RUNNING"})
        ev.emit("fault", generation=0, reason="Hang", node=0, rank=1, detection_latency_s=3.0)
        assert _get(port, "/status")[1]["state"] == "FAULTED"
        ev.emit("stopped", generation=0, ranks=[2, 3])
        ev.emit("restart", generation=1, kind="process", reason="Hang")
        ev.emit("restart", generation=2, kind="inprocess", reason="NonFiniteLoss", recovery_s=0.4)
        code, st = _get(port, "/status")
        assert code == 200 and st["state"] == "RUNNING" and st["generation"] == 2 and st["restart_count"] == 2
        assert st["restarts"] == {"process": 1, "inprocess": 1} and (st["node"], st["nnodes"], st["world_size"]) == (1, 2, 4)
        assert st["last_fault"]["reason"] == "Hang" and st["last_fault"]["node"] == 0 and st["last_fault"]["rank"] == 1
        assert {"INIT", "RUNNING", "FAULTED", "STOPPING"} == set(st["transitions"])
        assert _get(port, "/restart_count") == (200, {"restart_count": 2})
        ev.emit("exit", generation=2, code=1, why="CrashLoop")
        assert _get(port, "/health") == (503, {"healthy": False, "state": "FAILED"})
        assert _get(port, "/start")[0] == 404  # read-only: the agents drive themselves
    finally:
        api.close()
        ev.close()


def test_exit_codes_map_to_states() -> None:
    for code, state in ((0, "COMPLETED"), (75, "FULL_RESTART"), (70, "FAILED")):
        s = AgentStatus()
        s.on_event({"event": "exit", "generation": 0, "code": code})
        assert s.state == state


def test_bad_ports_are_typed_errors() -> None:
    with pytest.raises(ConfigError, match="--server-port must be a TCP port 0-65535"):
        ApiSettings(port=70000)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        with pytest.raises(ConfigError, match="cannot listen"):
            AgentApi.start(ApiSettings(port=held.getsockname()[1]), AgentStatus())
    assert AgentApi.start(ApiSettings(), AgentStatus()) is None  # no port: no server


def test_the_operator_metrics_are_scraped_with_every_kind_of_restart() -> None:
    ev = Events(path=None, node=0, metrics_port=0)
    try:
        ev.emit("started", generation=0, nnodes=2, world_size=2)
        ev.emit("fault", generation=0, reason="Crash", rank=1, detection_latency_s=0.25)
        ev.emit("restart", generation=1, kind="process")
        ev.emit("recovered", generation=1, recovery_s=1.5, kind="process")
        ev.emit("fault", generation=1, reason="NonFiniteLoss", rank=0)
        ev.emit("restart", generation=2, kind="inprocess", recovery_s=0.5)
        ev.emit("recovered", generation=0, recovery_s=30.0, kind="job")  # a full restart's next incarnation
        ev.emit("exit", generation=2, code=75)
        assert ev.server is not None
        samples, types = scrape(ev.server.port)
    finally:
        ev.close()
    assert types["tierckpt_run_detection_latency_seconds"] == "histogram"
    assert val(samples, "tierckpt_run_detection_latency_seconds_count", reason="Crash") == 1
    assert val(samples, "tierckpt_run_detection_latency_seconds_sum", reason="Crash") == 0.25
    assert val(samples, "tierckpt_run_recovery_seconds_sum", kind="process") == 1.5
    assert val(samples, "tierckpt_run_recovery_seconds_sum", kind="inprocess") == 0.5
    assert val(samples, "tierckpt_run_recovery_seconds_sum", kind="job") == 30.0
    # downtime = time to detect + time to recover, each fault once
    assert val(samples, "tierckpt_run_downtime_seconds_sum", kind="process") == 1.75
    assert val(samples, "tierckpt_run_downtime_seconds_sum", kind="inprocess") == 0.5
    assert val(samples, "tierckpt_run_downtime_seconds_total") == 32.25
    assert val(samples, "tierckpt_run_restarts_total", kind="inprocess") == 1
    assert val(samples, "tierckpt_run_jobs_started_total") == 1
    assert val(samples, "tierckpt_run_jobs_ended_total", outcome="full_restart") == 1


def test_train_scripts_run_as_processes_and_fail_typed(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    script = tmp_path / "prep.py"
    script.write_text(f"import os, sys\nopen({str(out)!r}, 'a').write(' '.join(sys.argv[1:]) + "
                      "' ' + os.environ['JOB_RESTART_COUNT'] + '\\n')\n")
    scripts = TrainScripts.from_args(pre=str(script), pre_args="--stage 'a b'", post=None, post_args="")
    assert scripts.pre_train({"JOB_RESTART_COUNT": "3"}) is not None and scripts.post_train({}) is None
    assert out.read_text() == "--stage a b 3\n"
    bad = tmp_path / "bad.py"
    bad.write_text("raise SystemExit(4)\n")
    with pytest.raises(TrainScriptError, match="exited with 4") as info:
        TrainScripts.from_args(pre=None, pre_args="", post=str(bad), post_args="").post_train({})
    assert (info.value.phase, info.value.code) == ("post_train", 4)
    plain = tmp_path / "plain.sh"
    plain.write_text("#!/bin/sh\nexit 0\n")  # no executable bit
    with pytest.raises(TrainScriptError, match="could not start"):
        TrainScripts.from_args(pre=str(plain), pre_args="", post=None, post_args="").pre_train({})
    with pytest.raises(ConfigError, match="no such file"):
        TrainScripts.from_args(pre=str(tmp_path / "missing.sh"), pre_args="", post=None, post_args="")
    with pytest.raises(ConfigError, match="--post-train-args given without --post-train-script"):
        TrainScripts.from_args(pre=None, pre_args="", post=None, post_args="--x")


def test_the_namespace_log_has_the_seeds_name_and_format(tmp_path: Path) -> None:
    assert SEED_LOG_DIR == "/var/log/sagemaker_checkpointing"
    handler = namespace_log("run1", str(tmp_path / "logs"))
    log = logging.getLogger("tierckpt.run")
    old = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        log.info("[Node %s] Generation %s: restart kind=process", 0, 1)
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
        handler.close()
    line = (tmp_path / "logs" / "run1_checkpointing.log").read_text().strip()
    assert "] [run1] [tierckpt.run] [INFO] [test_fidelity.py:" in line and line.endswith(
        "[Node 0] Generation 1: restart kind=process"), line


def _options(*argv: str) -> Any:
    from tierckpt.launcher.cli import _options, build_parser

    return _options(build_parser().parse_args([*argv, "train.py"]))


def test_shutdown_signal_is_the_stop_grace() -> None:
    assert _options().stop_grace_s == 0.0
    assert _options("--stop-grace", "5").stop_grace_s == 5.0
    assert _options("--shutdown-signal", "SIGTERM").stop_grace_s == 15.0  # hyperpodrun's default
    assert _options("--shutdown_signal=SIGTERM", "--shutdown-timeout=4").stop_grace_s == 4.0
    assert _options("--shutdown-signal", "SIGKILL", "--shutdown-timeout", "9").stop_grace_s == 0.0
    with pytest.raises(TierckptError, match="disagree"):
        _options("--shutdown-signal", "SIGKILL", "--stop-grace", "3")
    with pytest.raises(TierckptError, match="--stop-grace must be 0 or more"):
        _options("--stop-grace", "-1")
    opts = _options("--server-port", "0", "--server-host", "127.0.0.2", "--inprocess-restart",
                    "--inprocess-timeout", "30", "--server-log-level", "debug")
    assert opts.api == ApiSettings(host="127.0.0.2", port=0)


def test_a_bad_server_port_ends_tierckpt_run_before_any_worker(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from tierckpt.launcher.cli import main

    script = tmp_path / "train.py"
    script.write_text("print('never')\n")
    assert main(["--server-port", "70000", str(script)]) == 2
    assert "--server-port must be a TCP port 0-65535" in capsys.readouterr().err
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        assert main(["--server-port", str(held.getsockname()[1]), str(script)]) == 2
    assert "cannot listen" in capsys.readouterr().err
    assert main(["--checkpointing-log-dir", str(tmp_path), str(script)]) == 2
    assert "give --namespace too" in capsys.readouterr().err


def test_every_hyperpodrun_option_renders(tmp_path: Path) -> None:
    from tierckpt.cli import main as cli_main

    seed = Path(__file__).resolve().parents[3] / "deploy" / "k8s" / "examples" / "llama3_1_8b-fsdp-hpto.yaml"
    doc = yaml.safe_load(seed.read_text())
    flags = ["--server-host=0.0.0.0", "--server-port=8080", "--server-log-level=info",
             "--server-shutdown-timeout=300", "--shutdown-signal=SIGTERM", "--shutdown-timeout=15",
             "--pre-train-script=/opt/pre.sh", "--pre-train-args=--a 1", "--post-train-script=/opt/post.sh",
             "--post-train-args=--b", "--inprocess-restart", "--inprocess-timeout=60"]
    container = doc["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]
    container["command"] = ["hyperpodrun", *flags, "--nnodes=4", "--nproc_per_node=8", "/fsdp/train.py"]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out.yaml"
    assert cli_main(["k8s", "render", str(job), "-o", str(out)]) == 0
    text = out.read_text()
    for flag in flags:
        assert flag in text, flag
