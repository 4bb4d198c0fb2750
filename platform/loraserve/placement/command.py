"""`loraserve placement`: the placement loop as a command (a sidecar, or a Deployment of its own).

    loraserve placement --replica http://10.0.0.7:8001 http://10.0.0.8:8001 --copies 2 --budget 4
    loraserve placement --replicas-dns loraserve-metrics:8001 --once

Each flag also comes from the environment (`LORASERVE_PLACEMENT_KEY`, `LORASERVE_REPLICAS_DNS`, ...),
as for `loraserve serve`; pass the keys that way. It needs no model and imports no engine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable

from loraserve.placement.loop import PlacementLoop, PlacementSettings


def add_placement_command(commands: argparse._SubParsersAction, apply_env: Callable) -> None:
    parser = commands.add_parser(
        "placement",
        help="pre-load hot adapters on a few replicas and let cold ones go (docs/OPERATIONS.md, Placement)",
        description="Every INTERVAL seconds: read each replica's metrics listener (vllm:lora_adapter_loaded, "
        "loraserve_lora_requests_total), pin each hot adapter on COPIES replicas through the residency "
        "endpoints, and unpin adapters that went cold.",
    )
    add = parser.add_argument
    add(
        "--replica",
        nargs="+",
        default=[],
        metavar="URL",
        help="replicas' metrics listeners, http://HOST:8001",
    )
    add(
        "--replicas-dns",
        metavar="HOST:PORT",
        help="a headless Service (e.g. loraserve-metrics:8001): every address it resolves to, each round",
    )
    add("--copies", type=int, default=2, help="replicas each hot adapter is pinned on (k)")
    add("--budget", type=int, default=4, help="adapters pinned per replica at most (and max_loras - 1)")
    add("--interval", type=float, default=15.0, help="seconds between rounds")
    add("--min-rate", type=float, default=0.1, help="smoothed requests per round that make an adapter hot")
    add(
        "--unload-cold",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="free a cold adapter's GPU slot and CPU row when unpinning it (default: leave it to the LRU)",
    )
    add("--timeout", type=float, default=5.0, help="seconds per call to a replica")
    add("--once", action="store_true", help="one round, print what it did as JSON, exit")
    add("--placement-key", help="the replicas' --placement-key (prefer LORASERVE_PLACEMENT_KEY)")
    add("--metrics-key", help="the replicas' --metrics-key, if they have one (prefer LORASERVE_METRICS_KEY)")
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    apply_env(parser, os.environ)
    parser.set_defaults(func=run_placement)


def replica_source(urls: list[str], dns: str | None) -> Callable[[], list[str]]:
    """The replicas of each round: the given URLs, plus every address `dns` (HOST:PORT) resolves to now."""
    fixed = [u.rstrip("/") if "://" in u else f"http://{u.rstrip('/')}" for u in urls]
    if dns is None:
        return lambda: list(fixed)
    host, _, port = dns.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--replicas-dns expects HOST:PORT (got {dns!r})")

    def resolve() -> list[str]:
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as exc:
            logging.getLogger(__name__).warning("placement: cannot resolve %s: %s", host, exc)
            return list(fixed)
        addresses = sorted({info[4][0] for info in infos})
        return fixed + [f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}" for a in addresses]

    return resolve


def run_placement(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not args.placement_key:
        raise SystemExit("loraserve placement: set LORASERVE_PLACEMENT_KEY (the replicas' --placement-key)")
    if not args.replica and not args.replicas_dns:
        raise SystemExit(
            "loraserve placement: name the replicas with --replica URL ... or --replicas-dns HOST:PORT"
        )
    try:
        settings = PlacementSettings(
            copies=args.copies,
            budget=args.budget,
            min_rate=args.min_rate,
            unload_cold=args.unload_cold,
            timeout_s=args.timeout,
        )
        replicas = replica_source(args.replica, args.replicas_dns)
    except ValueError as exc:
        raise SystemExit(f"loraserve placement: {exc}") from None
    loop = PlacementLoop(replicas, settings, args.placement_key, args.metrics_key)
    try:
        if args.once:
            result = loop.run_once()
            summary = {
                "replicas": [v.url for v in result.views],
                "unreachable": result.unreachable,
                "rates": result.rates,
                "pins": {url: sorted(names) for url, names in result.desired.items()},
                "done": [f"{a.op} {a.adapter_name} on {a.url}" for a in result.done],
                "failed": result.failed,
            }
            print(json.dumps(summary, indent=2, sort_keys=True))
            return 1 if not result.views else 0
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        loop.run(args.interval, stop)
        return 0
    finally:
        loop.close()


if __name__ == "__main__":  # python -m loraserve.placement.command ... (same as `loraserve placement`)
    from loraserve.cli import main

    sys.exit(main(["placement", *sys.argv[1:]]))
