"""deploy/slurm/tierckpt.sbatch run with a fake Slurm environment: its srun and tierckpt run lines.

The fast test of the script: ``srun``, ``scontrol`` and ``sbatch`` are stand-ins on PATH (said
here, as the project's rules ask); the same script runs under a real Slurm in
``tests/cluster/test_slurm.py``, which the fakes follow. The fake srun starts its command once
per node with that node's SLURM_NODEID, as srun --ntasks-per-node=1 would, and returns the
highest exit code; the fake scontrol expands the node list and records every call in order
(``show job -o`` answers with ``$FAKE_EXC`` as the job's ExcNodeList; ``update`` fails as real
Slurm does for an unknown node name when ``$FAKE_UPDATE_FAILS`` is set), so the order of the
requeue, the exclusion and the release is checked against what real Slurm requires (an
ExcNodeList changes on a pending job only: a job the script requeues held is one while its
batch shell still runs); the fake sbatch answers ``--test-only`` as real Slurm does: it would
start the job, or (``$FAKE_TOO_FEW`` set, and the call excludes nodes) "Requested node
configuration is not available"; the fake tierckpt writes ``$FAKE_AVOID`` to its
``--avoid-file`` as the launcher does at a full restart. The batch script itself runs for real.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tierckpt.launcher.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "tierckpt.sbatch"

FAKE_SRUN = """#!/bin/bash
echo "$*" > "$FAKE_LOG/srun.argv"
while [[ "$1" == -* ]]; do shift; done
worst=0
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do
  SLURM_NODEID=$i "$@"; rc=$?
  (( rc > worst )) && worst=$rc
done
exit $worst
"""
FAKE_SCONTROL = """#!/bin/bash
[[ "$1" != show ]] && echo "$*" >> "$FAKE_LOG/scontrol.calls"
case "$1 $2" in
  "show hostnames") echo gpu-a; echo gpu-b ;;
  "show job") echo "JobId=$4 JobName=llama ReqNodeList=(null) ExcNodeList=${FAKE_EXC:-(null)} NodeList=gpu-[a-b]" ;;
  update*) [[ -n "${FAKE_UPDATE_FAILS:-}" ]] && { echo "Invalid node name specified for job 4242" >&2; exit 1; } ;;
  requeuehold*|release*) ;;
  requeue*) echo "$2" >> "$FAKE_LOG/requeued" ;;
  *) exit 9 ;;
esac
"""
FAKE_SBATCH = """#!/bin/bash
echo "$*" >> "$FAKE_LOG/sbatch.calls"
if [[ -n "${FAKE_TOO_FEW:-}" && "$*" == *--exclude=* ]]; then
  echo "allocation failure: Requested node configuration is not available" >&2; exit 1
fi
echo "sbatch: Job 4243 to start at 2026-11-27T04:01:45 using 2 processors on nodes gpu-[a-b] in partition gpu" >&2
"""
FAKE_TIERCKPT = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_LOG/tierckpt.$SLURM_NODEID"
echo "$TIERCKPT_AGENT_SECRET" > "$FAKE_LOG/secret.$SLURM_NODEID"
echo "$TIERCKPT_NODE_NAME" > "$FAKE_LOG/node_name.$SLURM_NODEID"
while [[ $# -gt 0 ]]; do
  if [[ "$1" == --avoid-file && -n "${FAKE_AVOID:-}" ]]; then printf '%s' "$FAKE_AVOID" > "$2"; fi
  shift
done
exit "$FAKE_RC"
"""


def run_sbatch(tmp_path: Path, rc: int, **env: str) -> tuple[int, Path, str]:
    bindir, log = tmp_path / "bin", tmp_path / "log"
    bindir.mkdir(parents=True)
    log.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("sbatch", FAKE_SBATCH),
                       ("tierckpt", FAKE_TIERCKPT)):
        (bindir / name).write_text(body)
        (bindir / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TIERCKPT_"))}
    base.update(PATH=f"{bindir}:{os.environ['PATH']}", FAKE_LOG=str(log), FAKE_RC=str(rc),
                SLURM_JOB_ID="4242", SLURM_JOB_NAME="llama", SLURM_JOB_NUM_NODES="2",
                SLURM_JOB_NODELIST="gpu-[a-b]", SLURM_JOB_PARTITION="gpu", SLURM_GPUS_ON_NODE="8", SLURM_SUBMIT_DIR=str(tmp_path))
    base.update(env)
    proc = subprocess.run(["bash", str(SBATCH), "train.py", "--lr", "3e-4", "--name", "a b"], env=base,
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, log, proc.stdout + proc.stderr


def test_the_script_asks_slurm_for_requeue_and_a_pre_timeout_signal() -> None:
    directives = [line.split(None, 1)[1] for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "--requeue" in directives and "--ntasks-per-node=1" in directives
    assert "--signal=TERM@120" in directives


def test_srun_runs_one_tierckpt_run_per_node(tmp_path: Path) -> None:
    rc, log, out = run_sbatch(tmp_path, 0, TIERCKPT_DURABLE_URL="s3://b/ckpt", TIERCKPT_JOB_FILE="/etc/job.yaml")
    assert rc == 0, out
    assert "--ntasks-per-node=1" in (log / "srun.argv").read_text().split()
    secrets = set()
    for node in (0, 1):
        argv = (log / f"tierckpt.{node}").read_text().splitlines()
        assert argv[0] == "run"
        a = build_parser().parse_args(argv[1:])  # the launcher's own (torchrun's) parser
        assert (a.nnodes, a.nproc_per_node, a.rdzv_backend) == ("2", "8", "tierckpt")
        assert a.rdzv_endpoint == "gpu-a:29400" and a.rdzv_id == "4242"
        assert a.namespace == "llama" and a.memory_dir == "/dev/shm/tierckpt"
        assert a.max_restarts == 10  # in-place restarts: torchrun's default (0) would end the job at the first crash
        assert a.durable_url == "s3://b/ckpt" and a.job == "/etc/job.yaml"
        assert a.events == f"{tmp_path}/tierckpt-logs/4242/events-{node}.jsonl"
        assert a.replicas == 1 and a.agent_listen == "0.0.0.0:7601" and a.peers == "gpu-a:7601,gpu-b:7601"
        assert a.training_script == "train.py" and a.training_script_args == ["--lr", "3e-4", "--name", "a b"]
        secrets.add((log / f"secret.{node}").read_text().strip())
    (secret,) = secrets  # one secret, the same on every node
    assert len(secret) == 64
    assert not (log / "requeued").exists()


def test_exit_75_requeues_the_job(tmp_path: Path) -> None:
    rc, log, out = run_sbatch(tmp_path, 75)
    assert rc == 75
    assert (log / "requeued").read_text().split() == ["4242"]
    assert (log / "scontrol.calls").read_text().splitlines() == ["requeue 4242"]  # nobody to avoid
    assert "requeueing job 4242" in out


def test_exit_75_excludes_the_avoided_nodes_from_the_requeued_job(tmp_path: Path) -> None:
    """The launchers named gpu-b at the full restart: the job is requeued held, gpu-b is added to
    the job's own exclusions while it is pending, and it is released; each node's launcher was
    told its Slurm node name and the hint file's path."""
    rc, log, out = run_sbatch(tmp_path, 75, FAKE_AVOID="gpu-b\n", FAKE_EXC="gpu-z", SLURMD_NODENAME="gpu-a")
    assert rc == 75, out
    assert (log / "scontrol.calls").read_text().splitlines() == [
        "requeuehold 4242", "update JobId=4242 ExcNodeList=gpu-z,gpu-b", "release 4242"]
    assert "avoids repeat offender(s) gpu-b" in out
    # asked first whether Slurm would start the job without them (it would)
    assert (log / "sbatch.calls").read_text().splitlines() == [
        "--test-only --nodes=2 --partition=gpu --exclude=gpu-z,gpu-b --wrap=true"]
    avoid = f"{tmp_path}/tierckpt-logs/4242/avoid"
    for node in (0, 1):
        assert build_parser().parse_args((log / f"tierckpt.{node}").read_text().splitlines()[1:]).avoid_file == avoid
        assert (log / f"node_name.{node}").read_text().strip() == "gpu-a"


def test_an_exclusion_that_leaves_too_few_nodes_is_not_made(tmp_path: Path) -> None:
    """Real Slurm keeps a job whose exclusions leave its partition fewer nodes than it needs
    pending for good (reason ``BadConstraints``, seen in tests/cluster with 4 hosts, 2 of them
    excluded at submission): the script asks ``sbatch --test-only`` with and without the
    exclusion and, where only the exclusion makes the job impossible, requeues it as it is."""
    rc, log, out = run_sbatch(tmp_path, 75, FAKE_AVOID="gpu-b\n", FAKE_EXC="gpu-[c-z]", FAKE_TOO_FEW="1")
    assert rc == 75, out
    assert (log / "scontrol.calls").read_text().splitlines() == ["requeue 4242"]
    assert (log / "sbatch.calls").read_text().splitlines() == [
        "--test-only --nodes=2 --partition=gpu --exclude=gpu-[c-z],gpu-b --wrap=true",
        "--test-only --nodes=2 --partition=gpu --wrap=true"]
    assert "not excluding repeat offender(s) gpu-b" in out and "Requested node configuration is not available" in out


def test_a_failed_exclusion_still_releases_the_job(tmp_path: Path) -> None:
    """``scontrol update`` refuses a name Slurm does not know (real Slurm: "Invalid node name
    specified"): the held job is released all the same, requeued without the exclusion."""
    rc, log, out = run_sbatch(tmp_path, 75, FAKE_AVOID="gpu-b\n", FAKE_UPDATE_FAILS="1")
    assert rc == 75, out
    assert (log / "scontrol.calls").read_text().splitlines() == [
        "requeuehold 4242", "update JobId=4242 ExcNodeList=gpu-b", "release 4242"]
    assert "could not exclude gpu-b; the job is requeued without it" in out


def test_a_stale_avoid_list_is_not_used_and_excluding_can_be_turned_off(tmp_path: Path) -> None:
    logs = tmp_path / "tierckpt-logs" / "4242"
    logs.mkdir(parents=True)
    (logs / "avoid").write_text("gpu-b\n")  # an earlier run's: this run's launchers wrote none
    rc, log, _ = run_sbatch(tmp_path, 75)
    assert rc == 75 and (log / "scontrol.calls").read_text().splitlines() == ["requeue 4242"]
    rc, log, _ = run_sbatch(tmp_path / "off", 75, FAKE_AVOID="gpu-b\n", TIERCKPT_AVOID_EXCLUDE="0")
    assert rc == 75 and (log / "scontrol.calls").read_text().splitlines() == ["requeue 4242"]


@pytest.mark.parametrize("code", [1, 143])
def test_other_failures_are_not_requeued(tmp_path: Path, code: int) -> None:
    rc, log, _ = run_sbatch(tmp_path, code)
    assert rc == code and not (log / "requeued").exists()


def test_single_node_without_replication(tmp_path: Path) -> None:
    rc, log, out = run_sbatch(tmp_path, 0, SLURM_JOB_NUM_NODES="1", NPROC_PER_NODE="4", TIERCKPT_NAMESPACE="ns1")
    assert rc == 0, out
    a = build_parser().parse_args((log / "tierckpt.0").read_text().splitlines()[1:])
    assert a.nnodes == "1" and a.nproc_per_node == "4" and a.namespace == "ns1" and a.replicas is None
    assert not (log / "tierckpt.1").exists()


def test_outside_slurm_it_says_so(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(SBATCH), "train.py"], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "run this with sbatch" in proc.stderr
