"""What ``tierckpt run`` hands its workers: the one place that knows the variable and file names.

    variable                  set by (launcher/)               read by
    TIERCKPT_NAMESPACE        workers/launch.py (--namespace)   config.py: CheckpointConfig.namespace
    TIERCKPT_MEMORY_DIR       workers/launch.py (--memory-dir)  config.py: CheckpointConfig.memory_dir
    TIERCKPT_DURABLE_URL      workers/launch.py (--durable-url) config.py: CheckpointConfig.durable_url
    TIERCKPT_RESUME_BEFORE    supervisor/torch_agent.py (control/resume.py's bound N)  config.py: CheckpointConfig.resume_before
    TIERCKPT_GENERATION       workers/launch.py: the job-wide restart count; config.py (a worker of tierckpt run)
    JOB_RESTART_COUNT         workers/launch.py: the same count, under hyperpodrun's name (the training script)
    TIERCKPT_MONITOR_DIR      workers/launch.py: the directory below  monitor.py, inprocess.py, waitsample.py
    TIERCKPT_INPROC_STORE     inprocess/replace.py: host:port/<generation> of the agent-hosted store   inprocess.py
    TIERCKPT_INPROC_JOIN      supervisor/torch_agent.py, on a replacement: the fault it replaces a rank for   inprocess.py
    TIERCKPT_WARM             workers/standby.py: "1" in a warm worker, "0" after a cold start in its place
    TIERCKPT_WARM_SINCE       workers/standby.py: when the warm worker's standby was spawned

    --warm-loader MODULE:FUNCTION   launcher/cli.py checks it (split_loader_spec); a standby
                                    runs the worker-side module PREWARM by name to build it

    $TIERCKPT_MONITOR_DIR/
        beat_<local rank>           heartbeats: monitor.py writes, the agent reads (heartbeat.read_beat)
        where_<local rank>          where an idle main thread waits: waitsample.py writes, procwatch.py reads
        inproc_<local rank>.jsonl   in-process restarts: inprocess.py appends, launcher/inprocess/restarts.py reads
        inproc_request              an increasing request counter: launcher/inprocess/restarts.py writes,
                                    inprocess.py's watchdog reads

Names only: the launcher writes them, the worker side (config.py, monitor.py, inprocess.py) reads them.
"""

from __future__ import annotations

__all__ = [
    "DURABLE_URL",
    "GENERATION",
    "INPROC_JOIN",
    "INPROC_REQUEST",
    "INPROC_STORE",
    "JOB_RESTART_COUNT",
    "MEMORY_DIR",
    "MONITOR_DIR",
    "NAMESPACE",
    "RESUME_BEFORE",
    "WARM",
    "WARM_SINCE",
    "PREWARM",
    "beat_file",
    "inproc_report",
    "split_loader_spec",
    "where_file",
]

NAMESPACE = "TIERCKPT_NAMESPACE"
MEMORY_DIR = "TIERCKPT_MEMORY_DIR"
DURABLE_URL = "TIERCKPT_DURABLE_URL"
RESUME_BEFORE = "TIERCKPT_RESUME_BEFORE"
GENERATION = "TIERCKPT_GENERATION"
JOB_RESTART_COUNT = "JOB_RESTART_COUNT"
MONITOR_DIR = "TIERCKPT_MONITOR_DIR"
INPROC_STORE = "TIERCKPT_INPROC_STORE"
INPROC_JOIN = "TIERCKPT_INPROC_JOIN"
WARM = "TIERCKPT_WARM"
WARM_SINCE = "TIERCKPT_WARM_SINCE"

INPROC_REQUEST = "inproc_request"

#: the worker-side module a warm standby runs by name for ``--warm-loader`` (``build``, ``worker_pids``, ``discard``)
PREWARM = "tierckpt.data.prewarm"


def split_loader_spec(spec: str) -> tuple[str, str] | None:
    """``"pkg.mod:make_loader"`` → (module, function); None when ``spec`` is not of that form."""
    mod, sep, fn = spec.partition(":")
    if not sep or not all(p.isidentifier() for p in mod.split(".")) or not all(p.isidentifier() for p in fn.split(".")):
        return None
    return mod, fn


def beat_file(local_rank: int) -> str:
    return f"beat_{local_rank}"


def where_file(local_rank: int) -> str:
    return f"where_{local_rank}"


def inproc_report(local_rank: int) -> str:
    return f"inproc_{local_rank}.jsonl"
