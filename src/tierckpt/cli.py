"""The ``tierckpt`` command: argv → config → library call; errors → exit codes.

    tierckpt [--namespace NS] [--memory-dir DIR] [--durable-url URL] ls
    tierckpt [...] verify STEP
    tierckpt demo [--steps N] [--workdir DIR]
    tierckpt run [torchrun arguments] [--job FILE ...] script ...
    tierckpt bench s3 [...]
    tierckpt agent serve|status|flush [...]                      the node agent (docs/agent.md)
Settings fall back to TIERCKPT_NAMESPACE, TIERCKPT_MEMORY_DIR, TIERCKPT_DURABLE_URL.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tierckpt.config import CheckpointConfig
from tierckpt.errors import CheckpointNotFoundError, TierckptError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierckpt", description="Tiered checkpoints for PyTorch: inspect, verify, demo, bench.")
    p.add_argument("--namespace", help="run namespace (else $TIERCKPT_NAMESPACE)")
    p.add_argument("--memory-dir", help="memory tier root (else $TIERCKPT_MEMORY_DIR or /dev/shm/tierckpt)")
    p.add_argument("--durable-url", help="file:///path or s3://bucket/prefix (else $TIERCKPT_DURABLE_URL)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("ls", help="steps in every tier: committed or not, files, sizes")
    v = sub.add_parser("verify", help="check every checksum of a step in every tier")
    v.add_argument("step", type=int)
    d = sub.add_parser("demo", help="tierckpt run on 2 nodes x 1 worker: SIGKILL a worker, watch the job recover")
    d.add_argument("--steps", type=int, default=40)
    d.add_argument("--workdir", default="demo-output")
    b = sub.add_parser("bench", help="benchmarks against the anchors")
    b.add_argument("suite", choices=["local", "s3", "replication", "recovery"],
                   help="local: memory tier against memcpy, torch.save, DCP; replication: agents against a socket copy")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    from tierckpt.agent.cli import add_arguments as add_agent_arguments

    add_agent_arguments(sub.add_parser("agent", help="the node agent: serve, status, flush"))
    from tierckpt.deploy.k8s import add_arguments as add_k8s_arguments
    add_k8s_arguments(sub.add_parser("k8s", help="Kubernetes: render a HyperPodPyTorchJob as JobSet/PyTorchJob manifests"))
    from tierckpt.compat.importer import add_arguments as add_import_arguments

    add_import_arguments(sub.add_parser("import", help="convert SageMaker checkpointing steps on S3 to tierckpt steps"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # torchrun's own parser takes the rest
        from tierckpt.launcher.cli import main as run_main

        return run_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            from tierckpt.demo import run_demo

            return run_demo(steps=args.steps, workdir=args.workdir)
        if args.command == "agent":
            from tierckpt.agent.cli import main as agent_main

            return agent_main(args)
        if args.command == "k8s":
            from tierckpt.deploy.k8s import main as k8s_main
            return k8s_main(args)
        if args.command == "import":
            from tierckpt.compat.importer import main as import_main

            return import_main(args)
        if args.command == "bench":
            import importlib

            bench = importlib.import_module(f"tierckpt.bench.{args.suite}")
            return int(bench.main(args.rest))
        config = CheckpointConfig.from_env(
            namespace=args.namespace, memory_dir=args.memory_dir, durable_url=args.durable_url
        )
        return _ls(config) if args.command == "ls" else _verify(config, args.step)
    except TierckptError as exc:
        print(f"tierckpt: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _tiers(config: CheckpointConfig):  # type: ignore[no-untyped-def]
    from tierckpt.tiers import open_durable, open_memory

    durable = open_durable(config)
    return [open_memory(config)] + ([durable] if durable is not None else [])


def _ls(config: CheckpointConfig) -> int:
    print(f"namespace {config.namespace}")
    print(f"{'tier':<8} {'step':>8} {'state':<10} {'files':>5} {'size':>12}  location")
    for tier in _tiers(config):
        listings = tier.list_steps(include_uncommitted=True)
        if not listings:
            print(f"{tier.name:<8} {'-':>8} {'(empty)':<10} {'':>5} {'':>12}  {tier.location()}")
        for s in listings:
            data = {n: size for n, size in s.files.items() if n.endswith(".distcp")}
            state = "committed" if s.committed else "partial"
            print(f"{tier.name:<8} {s.step:>8} {state:<10} {len(data):>5} {_human(sum(s.files.values())):>12}  {tier.location(s.step)}")
    return 0


def _verify(config: CheckpointConfig, step: int) -> int:
    from tierckpt.integrity import verify_copy

    reports = []
    for tier in _tiers(config):
        if any(s.step == step for s in tier.list_steps(include_uncommitted=True)):
            # a node's memory tier holds only its own ranks' files
            reports.append(verify_copy(tier, step, config.namespace, require_all_files=tier.name != "memory"))
    if not reports:
        raise CheckpointNotFoundError(f"step {step} of namespace {config.namespace!r} is in no tier", step=step)
    for r in reports:
        status = "OK" if r.ok else "BAD"
        print(f"{r.tier:<8} step {step}: {status}  {len(r.files_checked)} file(s) verified  {r.location}")
        for f in r.files_missing:
            print(f"           not on this node: {f}")
        for problem in r.problems:
            print(f"           {problem}")
    return 0 if all(r.ok for r in reports) else 4


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


if __name__ == "__main__":
    sys.exit(main())
