"""``tierckpt ls``: the steps of a namespace in every tier (committed or partial, files, sizes).

Without a namespace it lists the namespaces that exist. An unknown namespace is an error
(exit 3) that names the ones that do exist. ``--verify`` checks every checksum of every
committed step and marks the copies that fail (exit 4 when any does).
"""

from __future__ import annotations

import argparse

from tierckpt.commands.context import config_from, human, namespaces, tiers_of
from tierckpt.commands.progress import Progress
from tierckpt.errors import CheckpointNotFoundError, ConfigError, IntegrityError
from tierckpt.tiers import StepListing, Tier

__all__ = ["HELP", "add_arguments", "main"]

HELP = "steps of a namespace in every tier: committed or partial, files, sizes (no namespace: list them)"
STORAGE = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verify", action="store_true",
                   help="check every checksum of every committed step; mark the copies that fail (exit 4)")


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from(args)
    except ConfigError:
        if getattr(args, "namespace", None) is not None:
            raise
        return _list_namespaces(args)
    with tiers_of(config) as tiers:
        listings = [(tier, tier.list_steps(include_uncommitted=True)) for tier in tiers]
        if not any(steps for _, steps in listings):
            found = namespaces(config)
            if not any(config.namespace in names for names in found.values()):
                existing = sorted({ns for names in found.values() for ns in names})
                raise CheckpointNotFoundError(
                    f"namespace {config.namespace!r} does not exist (looked for "
                    + " and ".join(t.location() for t in tiers) + ")"
                    + ("; namespaces that exist: " + ", ".join(existing) if existing else "; no namespace exists there")
                )
        bad = _verify_all(config.namespace, listings) if args.verify else {}
        print(f"namespace {config.namespace}")
        check = "  check" if args.verify else ""
        print(f"{'tier':<8} {'step':>8} {'state':<10} {'data':>5} {'size':>12}{check}  location")
        for tier, steps in listings:
            if not steps:
                print(f"{tier.name:<8} {'-':>8} {'(empty)':<10} {'':>5} {'':>12}{'       ' if check else ''}  {tier.location()}")
            for s in steps:
                data = [n for n in s.files if n.endswith(".distcp")]
                state = "committed" if s.committed else "partial"
                mark = ""
                if args.verify:
                    mark = "  " + ("-    " if not s.committed else "BAD  " if (tier.name, s.step) in bad else "OK   ")
                print(f"{tier.name:<8} {s.step:>8} {state:<10} {len(data):>5} {human(sum(s.files.values())):>12}{mark}"
                      f"  {tier.location(s.step)}")
        for (tier_name, step), problems in sorted(bad.items()):
            for problem in problems:
                print(f"{tier_name} step {step}: {problem}")
    if bad:
        raise IntegrityError(f"{len(bad)} committed cop{'y fails' if len(bad) == 1 else 'ies fail'} verification: "
                             + ", ".join(f"{t} step {s}" for t, s in sorted(bad)) + "; see `tierckpt verify STEP`")
    return 0


def _verify_all(namespace: str, listings: list[tuple[Tier, list[StepListing]]]) -> dict[tuple[str, int], list[str]]:
    from tierckpt.tiers.integrity import verify_copy

    todo = [(tier, s) for tier, steps in listings for s in steps if s.committed]
    bad: dict[tuple[str, int], list[str]] = {}
    with Progress("verify", sum(sum(s.files.values()) for _, s in todo), unit="B") as bar:
        for tier, s in todo:
            report = verify_copy(tier, s.step, namespace, require_all_files=tier.name != "memory")
            if not report.ok:
                bad[(tier.name, s.step)] = report.problems
            bar.update(sum(s.files.values()), f"{tier.name} step {s.step}")
    return bad


def _list_namespaces(args: argparse.Namespace) -> int:
    config = config_from(args, namespace="tierckpt-probe")  # roots only: the namespace is not used
    found = namespaces(config)
    print(f"{'namespace':<32} tiers")
    every = sorted({ns for names in found.values() for ns in names})
    for ns in every:
        print(f"{ns:<32} {', '.join(t for t, names in found.items() if ns in names)}")
    if not every:
        print(f"(none under {config.memory_dir}" + (f" or {config.durable_url})" if config.durable_url else ")"))
    return 0
