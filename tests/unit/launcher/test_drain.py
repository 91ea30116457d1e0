"""Draining an unhealthy node (launcher/decide/drain.py, supervisor/draining.py, membership/avoid.py's
unhealthy nodes): the pure policy, the step boundary read from a real memory tier (real
``Checkpointer`` saves), and the drainer's store side on a real TCPStore with a real health
command that starts failing. A spare is one ticket drawn at the gate (``keys.SPARE_TICKETS``, the
one ``add`` a spare makes there); the scenario with real spares is tests/cluster/test_health.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.launcher.conftest import client
from tierckpt import CheckpointConfig, Checkpointer
from tierckpt.errors import ConfigError
from tierckpt.launcher.cli import _options, build_parser
from tierckpt.launcher.control import keys
from tierckpt.launcher.decide.drain import DrainPolicy, DrainStep
from tierckpt.launcher.decide.escalation import Fault
from tierckpt.launcher.decide.offenders import OffenderPolicy, attribute
from tierckpt.launcher.detect.health import HealthConfig
from tierckpt.launcher.events import Events
from tierckpt.launcher.inprocess.replace import Route, route
from tierckpt.launcher.membership.avoid import RepeatOffenders, unhealthy_nodes
from tierckpt.launcher.membership.change import DRAIN, missing_nodes, restart_history
from tierckpt.launcher.options import RunOptions
from tierckpt.launcher.supervisor.draining import Drainer, newest_boundary


def test_the_drain_policy() -> None:
    pol = DrainPolicy(wait_s=60)
    kw: dict[str, Any] = {"waiting_since": None, "boundary_then": None, "boundary_now": None, "now": 100.0}
    assert pol.next_step(healthy=True, spares=3, **kw)[0] is DrainStep.STAY
    assert pol.next_step(healthy=False, spares=0, **kw)[0] is DrainStep.REPORT
    assert pol.next_step(healthy=False, spares=1, **kw)[0] is DrainStep.WAIT
    kw.update(waiting_since=90.0, boundary_then=7, boundary_now=7)
    assert pol.next_step(healthy=False, spares=1, **kw)[0] is DrainStep.WAIT  # no new step yet
    assert pol.next_step(healthy=False, spares=1, **{**kw, "boundary_now": 8}) == (DrainStep.DRAIN, "step 8 committed")
    assert pol.next_step(healthy=False, spares=1, **{**kw, "boundary_then": None, "boundary_now": 0})[0] \
        is DrainStep.DRAIN  # the first step ever committed is a boundary too
    step, why = pol.next_step(healthy=False, spares=1, **{**kw, "now": 150.0})
    assert step is DrainStep.DRAIN and "within 60s" in why and "step 7" in why
    with pytest.raises(ConfigError, match="--health-drain-wait"):
        DrainPolicy(wait_s=0)


def test_a_drain_is_no_fault() -> None:
    """No restart counted, no offense, never in-process, no seat for a lost node."""
    f = Fault(generation=3, time=1.0, generation_started=0.0, reason=DRAIN, first_beat=True, step=5, resumed_step=2)
    assert restart_history([f]) == []
    assert attribute([{"reason": DRAIN, "node": 1, "time": 1.0}], [{1: "h1:/m"}]) == []
    assert route({"reason": DRAIN}, node=0, wrapped=True, budget_left=True) is Route.PROCESS
    assert missing_nodes({"reason": DRAIN, "node": 1}, 2, 2) == 0


def _save(cfg: CheckpointConfig, steps: range) -> None:
    with Checkpointer(cfg) as ck:
        for s in steps:
            ck.save(s, {"w": torch.full((16,), float(s))})
        ck.wait()


def test_the_step_boundary_is_the_newest_committed_and_replicated_step(shm_root: Path) -> None:
    assert newest_boundary(str(shm_root), "job", None) is None
    _save(CheckpointConfig(namespace="job", memory_dir=str(shm_root)), range(1, 4))
    _save(CheckpointConfig(namespace="other", memory_dir=str(shm_root)), range(1, 9))  # not this job's
    (shm_root / "job" / ".staging" / "step_9.x").mkdir(parents=True)  # a save in progress: no boundary
    assert newest_boundary(str(shm_root), "job", None) == 3
    assert newest_boundary(str(shm_root), None, None) == 3  # every namespace: the oldest newest one
    assert newest_boundary(str(shm_root), "job", {"job": 2}) == 2  # the spare loads the replica's step
    assert newest_boundary(str(shm_root), "job", {}) is None  # nothing replicated yet


def _drainer(tmp_path: Path, shm_root: Path, flag: Path, **health: Any) -> tuple[Drainer, Path]:
    path = tmp_path / "events.jsonl"
    opts = RunOptions(memory_dir=str(shm_root), namespace="job",
                      health=HealthConfig(checks=(), commands=(f"test ! -e {flag}",), fail_after=1, **health))
    return Drainer(opts, Events(str(path), node=1), identity="h1:/m", replicated=lambda: None), path


def _events(path: Path, name: str) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == name]


def _record(reason: str, detail: str) -> dict[str, Any]:
    return {"reason": reason, "node": 1, "detail": detail}


def test_an_unhealthy_node_waits_for_a_spare_then_for_the_next_committed_step(
        server: Any, tmp_path: Path, shm_root: Path) -> None:
    cfg = CheckpointConfig(namespace="job", memory_dir=str(shm_root))
    _save(cfg, range(1, 4))
    flag = tmp_path / "bad"
    store = client(server)
    drainer, path = _drainer(tmp_path, shm_root, flag)
    poll = lambda: drainer.poll(store, generation=2, node=1, record=_record)  # noqa: E731
    drainer.watch.run_once()
    assert poll() is None and unhealthy_nodes(store) == {}
    flag.touch()  # the health command starts failing
    drainer.watch.run_once()
    assert poll() is None  # no spare: reported, marked, it stays
    assert list(unhealthy_nodes(store)) == ["h1:/m"]
    (warning,) = _events(path, "warning")
    assert "no spare waits" in warning["what"] and "full job restart avoids it" in warning["what"]
    store.add(keys.SPARE_TICKETS, 1)  # a spare arrives at the gate
    time.sleep(1.05)  # the drainer asks for spares once a second
    assert poll() is None  # now it waits for the next step boundary (step 3 is the newest)
    (waiting,) = _events(path, "drain")
    assert (waiting["state"], waiting["step"]) == ("waiting", 3), waiting
    assert poll() is None
    _save(cfg, range(4, 5))
    claim = poll()
    assert claim is not None and claim["reason"] == DRAIN and claim["boundary"] == 4, claim
    assert claim["checks"] == ["command"] and f"test ! -e {flag}" in claim["detail"] and claim["why"] == "step 4 committed"
    flag.unlink()  # healthy again: the mark goes
    drainer.watch.run_once()
    assert poll() is None and unhealthy_nodes(store) == {}
    drainer.close()
    drainer.events.close()


def test_a_job_that_saves_rarely_does_not_keep_a_sick_node(server: Any, tmp_path: Path, shm_root: Path) -> None:
    flag = tmp_path / "bad"
    flag.touch()
    store = client(server)
    store.add(keys.SPARE_TICKETS, 1)
    drainer, _ = _drainer(tmp_path, shm_root, flag, drain_wait_s=0.3)
    drainer.watch.run_once()
    assert drainer.poll(store, generation=0, node=1, record=_record) is None  # waits ...
    time.sleep(0.35)
    claim = drainer.poll(store, generation=0, node=1, record=_record)
    assert claim is not None and "no new step committed within 0.3s" in claim["why"], claim
    drainer.close()
    drainer.events.close()


def test_unhealthy_nodes_are_kept_out_first_and_avoided_at_a_full_restart(server: Any) -> None:
    """With the offender policy off: an unhealthy node is still kept out where a spare takes its rank."""
    from tierckpt.launcher.membership.avoid import mark_unhealthy

    store = client(server)
    members = {0: "h0:/m", 1: "h1:/m"}
    off = RepeatOffenders(OffenderPolicy())
    mark_unhealthy(store, "h1:/m", "nic eth0: carrier down", time.time())
    assert not off.keep_out(store, 4, {"reason": "Crash", "node": 0, "time": 1.0}, members, spares=0,
                            unhealthy=list(unhealthy_nodes(store)))  # no spare: the job is not shrunk
    out = off.keep_out(store, 5, {"reason": DRAIN, "node": 1, "time": 2.0}, members, spares=1,
                       unhealthy=list(unhealthy_nodes(store)))
    assert (out.ranks, out.unhealthy) == ((1,), ("h1:/m",)), out
    avoided = off.at_full_restart(store, 6)
    assert [(a.identity, a.faults) for a in avoided] == [("h1:/m", 0)], avoided
    assert off.remembered == {}  # a drain is no offense


def test_health_options_from_the_command_line(tmp_path: Path) -> None:
    def opts(*argv: str) -> Any:
        return _options(build_parser().parse_args([*argv, "train.py"])).health

    h = opts("--standalone", "--memory-dir", str(tmp_path))
    assert (h.enabled, h.checks, h.interval_s, h.fail_after, h.memory_dir) == (True, None, 10.0, 2, str(tmp_path))
    h = opts("--rdzv-endpoint", "127.0.0.1:29400", "--health-check", "true", "--health-check", "test -d /",
             "--health-checks", "memfs,edac", "--health-interval", "2.5", "--health-fail-after", "3")
    assert (h.commands, h.checks, h.interval_s, h.fail_after) == (("true", "test -d /"), ("memfs", "edac"), 2.5, 3)
    assert h.nics == ("lo",)  # the interface that routes to the rendezvous endpoint
    assert opts("--health-nic", "eth7", "--health-checks", "none").nics == ("eth7",)
    assert not opts("--no-health").enabled
    with pytest.raises(ConfigError, match="--health-interval must be more than 0 seconds"):
        opts("--health-interval", "0")
    with pytest.raises(ConfigError, match="'/no/such/check' is not an executable file"):
        opts("--health-check", "/no/such/check --fast")
    with pytest.raises(ConfigError, match="unknown check.*'disks'"):
        opts("--health-checks", "nic,disks")
