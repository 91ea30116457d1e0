"""``tierckpt bench SUITE [options]``: the benchmarks against their anchors (docs/benchmarks.md).

Each suite has its own options: ``tierckpt bench SUITE --help``.
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["HELP", "SUITES", "add_arguments", "main"]

HELP = "benchmarks against the anchors; `tierckpt bench SUITE --help` for a suite's options"
SUITES = {
    "local": "memory tier against memcpy, torch.save and DCP",
    "s3": "durable drain and load over S3 against s3torchconnector (docs/s3.md)",
    "replication": "agents replicating a step against a raw socket copy",
    "wire": "ways to authenticate the peer stream (TLS 1.3, HMAC, GMAC, BLAKE3) against a plain socket copy",
    "recovery": "tierckpt run against torchrun: SIGKILL, SIGSTOP, NaN, lost node (--compile: in-process too)",
    "scale": "the launcher's control plane at N simulated nodes against torch's c10d rendezvous",
    "rdzv": "--rdzv-backend tierckpt at N simulated nodes (to 4096): rounds, a lost node with a spare, steady state",
    "data": "the first batch after a restart: a kept or warm-started loader against a plain DataLoader rebuilt",
    "gpu": "CUDA: overlapped save stall against the device-to-host copy; in-process restart (NCCL)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", choices=sorted(SUITES), metavar="SUITE",
                   help="; ".join(f"{k}: {v}" for k, v in SUITES.items()))
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="...", help="the suite's own options")


def main(args: argparse.Namespace) -> int:
    return int(importlib.import_module(f"tierckpt.bench.{args.suite}").main(args.rest))
