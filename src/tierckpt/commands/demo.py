"""``tierckpt demo``: a job under ``tierckpt run`` loses a worker to SIGKILL and recovers."""

from __future__ import annotations

import argparse

__all__ = ["HELP", "add_arguments", "main"]

HELP = "tierckpt run on 2 nodes x 1 worker: SIGKILL a worker, watch the job recover"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=40, help="training steps of the demo job (default 40)")
    p.add_argument("--workdir", default="demo-output", help="where the demo writes its files (default demo-output)")


def main(args: argparse.Namespace) -> int:
    from tierckpt.demo import run_demo

    return run_demo(steps=args.steps, workdir=args.workdir)
