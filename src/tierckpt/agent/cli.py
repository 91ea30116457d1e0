"""``tierckpt agent serve|status|flush``: argv → AgentConfig → the agent, or a request to it.

    tierckpt agent serve [--memory-dir DIR] [--listen HOST:PORT] [--peers H:P,...] [--node-id ID]
                         [--replicas K] [--secret-file F] [--memory-budget 40%|BYTES]
                         [--durable-url URL] [--metrics-port N] [--address-file F] [--fetch-streams N]
                         [--insecure-wire]
    tierckpt agent status [--memory-dir DIR] [--json]
    tierckpt agent flush  [--memory-dir DIR] [--namespace NS]
The secret comes from --secret-file, else $TIERCKPT_AGENT_SECRET; without one, loopback only, with
this user's own secret (~/.config/tierckpt/agent-secret, 0600: other local users cannot connect). Peers talk TLS 1.3 unless --insecure-wire (a fabric the user trusts).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from tierckpt.agent.config import AgentConfig, node_ram_bytes, parse_address, parse_budget, read_secret
from tierckpt.config import DEFAULT_MEMORY_DIR
from tierckpt.errors import StorageError, TierckptError

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="agent_command", required=True)
    s = sub.add_parser("serve", help="run this node's agent in the foreground")
    s.add_argument("--memory-dir", default=os.environ.get("TIERCKPT_MEMORY_DIR", DEFAULT_MEMORY_DIR))
    s.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT for peers (port 0 picks one)")
    s.add_argument("--peers", default="", help="other agents, HOST:PORT,HOST:PORT")
    s.add_argument("--node-id", default="", help="stable node identity (default: host + memory root)")
    s.add_argument("--replicas", type=int, default=1, help="peers that receive a copy of each newest step")
    s.add_argument("--secret-file", help="file holding the job secret (else $TIERCKPT_AGENT_SECRET)")
    s.add_argument("--memory-budget", help="node-wide cap: 20-100%% of RAM, or bytes (64G)")
    s.add_argument("--durable-url", help="file:///path or s3://bucket/prefix, for flush")
    s.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT")
    s.add_argument("--address-file", help="write the bound HOST:PORT here once listening")
    s.add_argument("--scan-interval", type=float, default=1.0)
    s.add_argument("--insecure-wire", action="store_true",
                   help="peers talk without TLS (no encryption, no stream integrity): only on a fabric you trust; "
                        "every agent of the job must agree")
    s.add_argument("--fetch-streams", type=int, default=4,
                   help="connections one large file's fetch for a load uses at once (parts >= 64 MiB)")
    for name, text in (("status", "what the node's agent holds and where its replicas are"),
                       ("flush", "drain each namespace's newest memory step to durable, and wait")):
        c = sub.add_parser(name, help=text)
        c.add_argument("--memory-dir", default=os.environ.get("TIERCKPT_MEMORY_DIR", DEFAULT_MEMORY_DIR))
        if name == "status":
            c.add_argument("--json", action="store_true")
        else:
            c.add_argument("--namespace")


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    peers = tuple(parse_address(a.strip()) for a in args.peers.split(",") if a.strip())
    budget = parse_budget(args.memory_budget, node_ram_bytes()) if args.memory_budget else None
    return AgentConfig(memory_dir=os.path.abspath(args.memory_dir), listen=parse_address(args.listen), peers=peers,
                       node_id=args.node_id, replicas=args.replicas, secret=read_secret(args.secret_file),
                       insecure_wire=args.insecure_wire,
                       budget_bytes=budget, durable_url=args.durable_url, scan_interval_s=args.scan_interval,
                       metrics_port=args.metrics_port, fetch_streams=args.fetch_streams)


def main(args: argparse.Namespace) -> int:
    try:
        if args.agent_command == "serve":
            return _serve(config_from_args(args), args.address_file)
        from tierckpt.tiers.peer import local_request

        if args.agent_command == "flush":
            reply = local_request(args.memory_dir, {"op": "flush", "ns": args.namespace}, timeout=3600)
            print(json.dumps(reply, indent=2))
            return 0 if reply.get("ok") else 7
        reply = local_request(args.memory_dir, {"op": "status"}, timeout=30)
        print(json.dumps(reply, indent=2) if args.json else _format_status(reply))
        return 0
    except StorageError as exc:
        print(f"tierckpt agent: error: {exc} (is `tierckpt agent serve --memory-dir ...` running?)", file=sys.stderr)
        return exc.exit_code
    except TierckptError as exc:
        print(f"tierckpt agent: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _serve(cfg: AgentConfig, address_file: str | None) -> int:
    import logging

    from tierckpt.agent import start_agent

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    handle = start_agent(cfg)
    metrics = None
    if cfg.metrics_port is not None:
        from tierckpt.metrics import serve

        metrics = serve(handle._agent.metrics.registry, cfg.metrics_port)
    host, port = handle.address
    if address_file:
        tmp = f"{address_file}.tmp-{os.getpid()}-{os.urandom(4).hex()}"  # unique per writer
        with open(tmp, "w") as f:
            f.write(f"{host}:{port}\n")
        os.replace(tmp, address_file)
    print(f"listening on {host}:{port} node {handle.node_id}", flush=True)
    try:
        stop.wait()
    finally:
        if metrics is not None:
            metrics.close()
        handle.close()
    return 0


def _format_status(s: dict[str, Any]) -> str:
    lines = [f"node {s['node']}  peers at {s['address']}  memory {s['memory_dir']}"]
    budget = s.get("budget_bytes")
    used = s.get("used_bytes", 0)
    held = s.get("held_bytes", {})
    lines.append(f"budget: {used / 2**20:.1f} MiB used" + (f" of {budget / 2**20:.1f} MiB ({100 * used / budget:.0f} %)"
                                                          if budget else " (no cap)")
                 + "; held: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(held.items())))
    evictions = s.get("evictions", {})
    if any(evictions.values()):
        lines.append("evicted: " + ", ".join(f"{int(v)} {k}" for k, v in sorted(evictions.items())))
    peers = s.get("peers", {})
    lines.append("peers: " + (", ".join(f"{n} ({a})" for a, n in peers.items()) or "none reachable"))
    lines.append("replicating to: " + (", ".join(s.get("ring_targets", [])) or "nobody")
                 + f"; lag {s.get('replication_lag_s', 0):.1f}s")
    last = s.get("last_replication") or {}
    if last:
        rate = last["bytes"] / last["seconds"] / 1e6 if last.get("seconds") else 0.0
        lines.append(f"last replication: {last['namespace']} step {last['step']} to {last['to']}, "
                     f"{last['bytes'] / 1e6:.1f} MB in {last['seconds']:.3f}s ({rate:.0f} MB/s)")
    fetch = s.get("last_fetch") or {}
    if fetch:
        rate = fetch["bytes"] / fetch["seconds"] / 1e6 if fetch.get("seconds") else 0.0
        lines.append(f"last data file fetched for a load: {fetch['namespace']} step {fetch['step']} {fetch['name']} from "
                     f"{fetch['from']}, {fetch['bytes'] / 1e6:.1f} MB in {fetch['seconds']:.3f}s ({rate:.0f} MB/s)")
    for ns, info in sorted(s.get("namespaces", {}).items()):
        rep = info.get("replicated") or {}
        where = f"step {rep['step']} on {', '.join(rep['to'])}" if rep.get("to") else "not yet"
        drain = info.get("drain") or {}
        lag = (f"; drain lag {drain['lag_steps']} steps (newest durable {drain.get('newest_durable')})"
               if "lag_steps" in drain else "")
        lines.append(f"  {ns}: steps {info['steps']}; replicas: {where}{lag}")
    for origin, spaces in sorted(s.get("replicas_held", {}).items()):
        for ns, steps in sorted(spaces.items()):
            lines.append(f"  replica of {origin}: {ns} steps {steps}")
    drain = s.get("drain") or {}
    if drain:
        lines.append(f"last flush: {json.dumps(drain.get('drained', {}))}")
    return "\n".join(lines)


def standalone(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tierckpt.agent", description="the tierckpt node agent")
    add_arguments(p)
    return main(p.parse_args(argv))
