"""``python -m lathe.checkpoints --port P --root DIR [--host H]``: one checkpoints server process.

Prints one line ``lathe.checkpoints listening on HOST:PORT`` to stdout when it serves (with the port it picked
when given port 0), answers gRPC health, serves ``/metrics`` with ``--metrics-port`` (saying where on stdout),
sweeps expired checkpoints periodically, and stops on SIGINT or SIGTERM. Logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from lathe.probes import add_metrics_port, serve_metrics
from lathe.serving import READY_MARK

from .server import serve

NAME = "lathe.checkpoints"


async def _run(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    running = await serve(args.port, args.root, args.host, sweep_interval_s=args.sweep_interval)
    if args.metrics_port >= 0:
        serve_metrics(NAME, running.probes.registry, args.host, args.metrics_port)
    print(f"{NAME}{READY_MARK}{args.host}:{running.port}", flush=True)
    await stop.wait()
    await running.stop(grace=2.0)
    print(f"{NAME} stopped", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {NAME}")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 = pick a free port (printed in the ready line)")
    ap.add_argument("--root", required=True, help="store: a directory, or a URL such as file:///abs/dir")
    add_metrics_port(ap)
    ap.add_argument("--sweep-interval", type=float, default=60.0, help="seconds between TTL sweeps")
    args = ap.parse_args()
    if args.sweep_interval <= 0:
        ap.error(f"--sweep-interval must be > 0, got {args.sweep_interval}")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(_run(args))


if __name__ == "__main__":
    main()
