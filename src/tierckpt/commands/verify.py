"""``tierckpt verify STEP``: every checksum of one step, in every tier that holds it (exit 4 if bad)."""

from __future__ import annotations

import argparse

from tierckpt.commands.context import config_from, copies_of, require_copies, step_arg, tiers_of
from tierckpt.commands.progress import Progress
from tierckpt.errors import IntegrityError

__all__ = ["HELP", "add_arguments", "main"]

HELP = "check every checksum of a step in every tier that holds it (exit 4 if a copy is bad)"
STORAGE = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("step", type=step_arg, metavar="STEP", help="the step to check")


def main(args: argparse.Namespace) -> int:
    from tierckpt.tiers.integrity import verify_copy

    config = config_from(args)
    with tiers_of(config) as tiers:
        # partial copies too: a torn one shows as BAD with what is missing
        copies = copies_of(tiers, args.step, committed_only=False) or require_copies(config, tiers, args.step)
        reports = []
        with Progress("verify", sum(sum(s.files.values()) for _, s in copies), unit="B") as bar:
            for tier, s in copies:
                # a node's memory tier holds only its own ranks' files
                reports.append(verify_copy(tier, args.step, config.namespace, require_all_files=tier.name != "memory"))
                bar.update(sum(s.files.values()), tier.name)
    for r in reports:
        status = "OK" if r.ok else "BAD"
        print(f"{r.tier:<8} step {args.step}: {status}  {len(r.files_checked)} file(s) verified  {r.location}")
        for f in r.files_missing:
            print(f"           not on this node: {f}")
        for problem in r.problems:
            print(f"           {problem}")
    bad = [r.tier for r in reports if not r.ok]
    if bad:
        raise IntegrityError(f"step {args.step}: the {' and '.join(bad)} cop{'y fails' if len(bad) == 1 else 'ies fail'}"
                             " verification; loads fall back to a good copy, if one is left", step=args.step)
    return 0
