"""Issue 15's launcher defaults and input checks, without workers: the restart limit and the
option that set it, restarts counted across full job restarts, the resume bound after a
non-finite loss (pure rules and the store keys every node agrees through), the checks made
before any worker starts, and rendezvous progress lines."""

from __future__ import annotations

import io
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from tierckpt.launcher.control import resume
from tierckpt.launcher.decide.escalation import Action, EscalationPolicy, Fault, restarts_before
from tierckpt.launcher.membership.rdzvwait import RendezvousProgress

T0 = 1_700_000_000.0


def _opts(argv: list[str]) -> Any:
    from tierckpt.launcher.cli import _options, build_parser

    return _options(build_parser().parse_args([*argv, "train.py"]))


def _fault(generation: int, reason: str = "Crash", step: int | None = None) -> Fault:
    t = T0 + 1000 * generation
    return Fault(generation=generation, time=t, generation_started=t - 500, reason=reason, first_beat=True,
                 step=step, resumed_step=None)


# --- item 5: recovering by default; the exit reason names the option that set the limit -------


def test_max_restarts_defaults_to_recovering() -> None:
    esc = _opts([]).escalation
    assert (esc.job_max_retry_count, esc.job_max_retry_source) == (10, "--max-restarts (default 10)")


def test_a_given_max_restarts_is_kept_and_named() -> None:
    esc = _opts(["--max-restarts", "3"]).escalation
    assert (esc.job_max_retry_count, esc.job_max_retry_source) == (3, "--max-restarts 3")
    assert _opts(["--max-restarts", "0"]).escalation.job_max_retry_count == 0  # torchrun's "no restarts"


def test_job_file_overrides_max_restarts(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("jobMaxRetryCount: 5\n")
    esc = _opts(["--max-restarts", "3", "--job", str(job)]).escalation
    assert (esc.job_max_retry_count, esc.job_max_retry_source) == (5, "runPolicy.jobMaxRetryCount 5")


def test_the_memory_dir_falls_back_to_TIERCKPT_MEMORY_DIR(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The workers read TIERCKPT_MEMORY_DIR from the environment; the launcher keeps its restart
    state and rank file beside the same root and its hosted agent (a 2-node job replicates by
    default) serves it, not /dev/shm/tierckpt (hyperpodrun's test left a rank file there). An
    explicit --memory-dir wins over the environment."""
    memory = str(tmp_path / "shm")
    monkeypatch.setenv("TIERCKPT_MEMORY_DIR", memory)
    opts = _opts(["--nnodes", "2"])
    assert opts.memory_dir == memory
    assert opts.agent is not None and opts.agent.memory_dir == memory
    assert _opts(["--memory-dir", str(tmp_path / "given")]).memory_dir == str(tmp_path / "given")
    monkeypatch.delenv("TIERCKPT_MEMORY_DIR")
    assert _opts([]).memory_dir is None  # unset: the default root, as before


def test_help_states_the_default_and_why() -> None:
    from tierckpt.launcher.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "default 10, torchrun's is 0" in text and "should recover from each" in text


@pytest.mark.parametrize("source, option", [("--max-restarts (default 10)", "--max-restarts"),
                                            ("--max-restarts 3", "--max-restarts"),
                                            ("runPolicy.jobMaxRetryCount 5", "runPolicy.jobMaxRetryCount")])
def test_exit_reason_names_the_option(source: str, option: str) -> None:
    policy = EscalationPolicy(job_max_retry_count=1, job_max_retry_source=source)
    decision = policy.decide([_fault(0), _fault(1)])
    assert (decision.action, decision.reason) == (Action.FAIL, f"{source} reached")
    assert decision.detail.endswith(f"raise {option}")


# --- item 6: restarts in all, across full job restarts -------------------------------------------


def test_restarts_before_an_incarnation_come_from_the_generation() -> None:
    # generations 0 and 1 ran in an earlier incarnation (a process restart, then a full job
    # restart); the restart-state file carried next_generation 2 into this one
    assert restarts_before([]) == 0
    assert restarts_before([_fault(0)]) == 0
    assert restarts_before([_fault(2), _fault(3)]) == 2
    policy = EscalationPolicy(job_max_retry_count=2)
    history = [_fault(2)]
    decision = policy.decide(history, prior_restarts=restarts_before(history))
    assert (decision.action, decision.reason) == (Action.FAIL, "jobMaxRetryCount (2) reached")


# --- item 2: TIERCKPT_RESUME_BEFORE ------------------------------------------------------------


def _nan(generation: int, step: int) -> dict[str, Any]:
    return {"generation": generation, "reason": "NonFiniteLoss", "step": step + 2, "resume_before": step}


def test_a_non_finite_loss_sets_the_bound_to_its_step() -> None:
    assert resume.advance(None, _nan(0, 8), moved=False) == 8
    # the record's own step (the newest beat) is later; the first non-finite step counts
    assert resume.advance(None, {"reason": "NonFiniteLoss", "step": 9}, moved=False) == 9


def test_the_bound_stays_until_a_generation_moved_past_it() -> None:
    bound = resume.advance(None, _nan(0, 8), moved=False)
    crash = {"generation": 1, "reason": "Crash", "step": 7}
    bound = resume.advance(bound, crash, moved=False)  # a crash right after the NaN restart
    assert bound == 8
    assert resume.advance(bound, {"generation": 2, "reason": "Hang", "step": 30}, moved=True) is None


def test_a_repeated_nan_keeps_the_lower_bound() -> None:
    assert resume.advance(8, _nan(1, 8), moved=False) == 8
    assert resume.advance(8, _nan(1, 6), moved=False) == 6
    assert resume.advance(8, _nan(1, 12), moved=True) == 12  # moved past 8, then NaN again at 12


def test_a_nan_that_comes_back_at_the_same_step_is_no_progress() -> None:
    """Resumed below step 8 each time, the job meets the NaN at step 8 again: NoProgress ends it
    (before, each generation resumed the poisoned newest step and got one step further)."""
    policy = EscalationPolicy(job_max_retry_count=10)
    history = [_fault(g, "NonFiniteLoss", step=8) for g in range(4)]
    assert [policy.decide(history[: n + 1]).action for n in range(4)] == [Action.RESTART] * 3 + [Action.FAIL]
    assert policy.decide(history).reason == "NoProgress"


def test_moved_past_needs_every_rank_finite_at_or_past_the_bound() -> None:
    assert resume.moved_past([(8, False), (9, False)], 8)
    assert not resume.moved_past([(8, False), (7, False)], 8)
    assert not resume.moved_past([(9, True)], 8)  # a non-finite beat this generation
    assert not resume.moved_past([(None, False)], 8)
    assert not resume.moved_past([], 8)


def test_nodes_agree_through_the_store() -> None:
    from torch.distributed import HashStore

    store = HashStore()
    resume.offer(store, 3, None)  # a node without a bound offers nothing
    assert resume.agreed(store, 3) is None
    resume.offer(store, 3, 8)
    resume.offer(store, 2, 5)  # a stale file (an older generation): another key
    resume.offer(store, 3, 9)  # the first offer wins
    assert resume.agreed(store, 3) == 8
    assert not resume.passed(store, 3, nnodes=2)
    resume.mark_past(store, 3)
    assert not resume.passed(store, 3, nnodes=2)
    resume.mark_past(store, 3)
    assert resume.passed(store, 3, nnodes=2)


# --- checks before any worker starts --------------------------------------------------------------


def _main(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    from tierckpt.launcher.cli import main

    code = main(argv)
    return code, capsys.readouterr().err


def _script(tmp_path: Path) -> str:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    return str(script)


def test_bad_rendezvous_endpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = _main(capsys, ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:notaport",
                               _script(tmp_path)])
    assert code == 2 and err.count("\n") == 1 and err.startswith("tierckpt run: error: --rdzv-endpoint"), err
    assert "is not HOST:PORT" in err


def test_unresolvable_rendezvous_host(capsys: pytest.CaptureFixture[str]) -> None:
    from tierckpt.errors import ConfigError
    from tierckpt.launcher.preflight import check_endpoint

    assert check_endpoint("localhost:29400", wait_s=0) == ("localhost", 29400)
    with pytest.raises(ConfigError, match="host 'no-such-host.invalid' does not resolve"):
        check_endpoint("no-such-host.invalid:29400", wait_s=1.0)  # waited for (a DNS name may come late)
    assert "waiting up to 1s for no-such-host.invalid to resolve" in capsys.readouterr().err


def test_events_folder_missing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = _main(capsys, ["--events", str(tmp_path / "nope" / "ev.jsonl"), _script(tmp_path)])
    assert code == 2 and err.count("\n") == 1 and "does not exist; create it first" in err, err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_memory_dir_not_writable(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        code, err = _main(capsys, ["--memory-dir", str(ro), _script(tmp_path)])
        code2, err2 = _main(capsys, ["--memory-dir", str(ro / "sub"), _script(tmp_path)])
    finally:
        ro.chmod(stat.S_IRWXU)
    assert code == 2 and "is not writable by this user" in err and err.count("\n") == 1, err
    assert code2 == 2 and "cannot be created" in err2, err2


def test_script_missing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = _main(capsys, [str(tmp_path / "trian.py")])
    assert code == 2 and err.count("\n") == 1 and "does not exist" in err and "trian.py" in err, err


def test_a_module_is_not_checked_as_a_file() -> None:
    from tierckpt.launcher.preflight import check_script

    check_script("pkg.train", module=True, no_python=False)
    check_script(sys.executable, module=False, no_python=True)


# --- rendezvous progress ------------------------------------------------------------------------


def test_progress_line_without_torch_state_says_where() -> None:
    out = io.StringIO()
    with RendezvousProgress(object(), "head:29400", first_after_s=0.05, every_s=0.05, out=out) as p:
        assert p.line() == "tierckpt run: waiting for nodes at head:29400"
        import time

        deadline = time.monotonic() + 10
        while "waiting" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
    assert out.getvalue().startswith("tierckpt run: waiting for nodes at head:29400\n")


def test_events_carry_node_index_and_host(tmp_path: Path) -> None:
    import json

    from tierckpt.launcher.events import Events

    ev = Events(str(tmp_path / "ev.jsonl"), node=None, host="trn-17")
    ev.emit("warning", generation=0, what="before the rendezvous")
    ev.node = 1
    ev.emit("started", generation=0)
    ev.close()
    recs = [json.loads(x) for x in (tmp_path / "ev.jsonl").read_text().splitlines()]
    # held back until the rendezvous gave the node its index, then written with it
    assert [(r["event"], r["node"], r["host"]) for r in recs] == [("warning", 1, "trn-17"), ("started", 1, "trn-17")]
    never = Events(str(tmp_path / "never.jsonl"), node=None)
    never.emit("exit", generation=0, code=2)
    never.close()  # never joined: written without an index rather than lost
    assert [json.loads(x)["node"] for x in (tmp_path / "never.jsonl").read_text().splitlines()] == [None]


def test_the_lowest_non_finite_step_any_node_offers_is_the_bound(server: Any) -> None:
    """The node whose claim wins may have seen the NaN a step later (through the all-reduce) than
    the NaN rank's node: the bound is the lowest offer, whatever the order (a real TCPStore).
    Seen in the slow tier before the fix: the bound came out 9 for a NaN at step 8."""
    from tierckpt.launcher.control import resume

    assert resume.lowest_non_finite(server, 3) is None
    resume.offer_non_finite(server, 3, 9)
    resume.offer_non_finite(server, 3, None)  # a node whose ranks saw no NaN offers nothing
    assert resume.lowest_non_finite(server, 3) == 9
    resume.offer_non_finite(server, 3, 8)
    resume.offer_non_finite(server, 3, 10)
    assert resume.lowest_non_finite(server, 3) == 8
    assert resume.lowest_non_finite(server, 4) is None  # per generation
    claim = {"reason": "NonFiniteLoss", "step": 9, "resume_before": 9}
    assert resume.advance(None, claim, False, lowest=8) == 8  # the claim said 9: the lowest offer wins
    assert resume.advance(None, claim, False, lowest=None) == 9
    assert resume.advance(None, {"reason": "Crash", "step": 9}, False, lowest=8) is None  # only after a NaN
