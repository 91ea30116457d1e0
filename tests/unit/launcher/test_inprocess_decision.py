"""The agent's in-process decision (launcher/inprocess/restarts.py) on real report files, no processes."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from tierckpt.launcher.events import Events
from tierckpt.launcher.inprocess.restarts import InProcessRestarts
from tierckpt.workerenv import INPROC_REQUEST


def _write(d: Path, lr: int, **rec: object) -> None:
    with open(d / f"inproc_{lr}.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def _events(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_only_live_process_faults_of_wrapped_workers_go_in_process(tmp_path: Path) -> None:
    ev = Events(str(tmp_path / "ev.jsonl"), node=0)
    ip = InProcessRestarts(ev)
    ip.arm(str(tmp_path), [0, 1])
    assert not ip.handles({"reason": "Hang"}), "workers not under the wrapper"
    _write(tmp_path, 0, event="ready", k=0)
    assert not ip.handles({"reason": "Hang"}), "one local worker is not under the wrapper"
    _write(tmp_path, 1, event="ready", k=0)
    assert ip.handles({"reason": "Hang"}) and ip.handles({"reason": "NonFiniteLoss"})
    for reason in ("Crash", "LostNode", "MembershipChange", "LostStore", "FaultDeadline", "ActiveDeadline"):
        assert not ip.handles({"reason": reason}), reason
    ev.close()


def test_worker_restart_becomes_inprocess_events_once_all_ranks_reported(tmp_path: Path) -> None:
    ev = Events(str(tmp_path / "ev.jsonl"), node=0)
    ip = InProcessRestarts(ev)
    ip.arm(str(tmp_path), [0, 1])
    now = time.time()
    _write(tmp_path, 1, event="restart", k=1, reason="NonFiniteLoss", rank=1, fault_time=now, stages_s={})
    assert not ip.poll(0)
    _write(tmp_path, 0, event="restart", k=1, reason="NonFiniteLoss", rank=0, fault_time=now + 0.1, stages_s={})
    assert ip.poll(0) and not ip.poll(0)
    ev.close()
    recs = _events(tmp_path / "ev.jsonl")
    assert [(e["event"], e.get("kind")) for e in recs] == [("fault", None), ("restart", "inprocess")]
    assert recs[0]["reason"] == "NonFiniteLoss" and recs[0]["rank"] == 1


def test_the_fault_event_names_the_rank_whose_fault_it_was(tmp_path: Path) -> None:
    """A node whose worker restarted because of a peer's NaN reports the peer (``fault_rank``), not
    itself: the chaos soak saw node 1 blame rank 1 for rank 0's NaN."""
    ev = Events(str(tmp_path / "ev.jsonl"), node=1)
    ip = InProcessRestarts(ev)
    ip.arm(str(tmp_path), [0])
    _write(tmp_path, 0, event="restart", k=1, reason="NonFiniteLoss", rank=1, fault_rank=0, fault_time=time.time(),
           error="RuntimeError: Connection closed by peer", stages_s={})
    assert ip.poll(0)
    ev.close()
    fault = _events(tmp_path / "ev.jsonl")[0]
    assert fault["event"] == "fault" and fault["rank"] == 0 and fault["reason"] == "NonFiniteLoss", fault


def test_request_waits_for_every_local_worker_and_times_out(tmp_path: Path) -> None:
    ev = Events(str(tmp_path / "ev.jsonl"), node=0)
    ip = InProcessRestarts(ev, timeout_s=0.3)
    ip.arm(str(tmp_path), [0])
    assert ip.restart(3, "Hang") is None, "nobody answered: the process path"
    assert (tmp_path / INPROC_REQUEST).read_text() == "1"

    def answer() -> None:
        time.sleep(0.05)
        _write(tmp_path, 0, event="restart", k=1, reason="launcher request", rank=0, fault_time=time.time())

    ip = InProcessRestarts(ev, timeout_s=5.0)
    ip.arm(str(tmp_path), [0])
    t = threading.Thread(target=answer)
    t.start()
    assert ip.restart(3, "Hang") is not None
    t.join()
    ev.close()
    assert _events(tmp_path / "ev.jsonl")[-1]["kind"] == "inprocess"


def test_a_request_is_abandoned_at_once_when_a_node_is_counted_lost(tmp_path: Path) -> None:
    """A rank blocked in a collective with a peer on a lost machine never reports its in-process
    restart: the request ends when the liveness verdict counts a node lost, not after its 30 s
    (the chaos soak: a node lost under tierckpt.resilient took 46 s to train again)."""
    ev = Events(str(tmp_path / "ev.jsonl"), node=0)
    ip = InProcessRestarts(ev, timeout_s=30.0)
    ip.arm(str(tmp_path), [0])
    lost_at = time.monotonic() + 0.3
    t0 = time.monotonic()
    assert ip.restart(3, "Hang", abandon=lambda: [1] if time.monotonic() >= lost_at else []) is None
    assert time.monotonic() - t0 < 5.0
    ev.close()
