"""``python -m lathe.checkpoints --port P --root DIR [--host H]``: one checkpoints server process.

Prints one line ``lathe.checkpoints listening on HOST:PORT`` to stdout when it serves (with the port it picked
when given port 0), answers gRPC health, serves ``/metrics`` with ``--metrics-port`` (saying where on stdout),
sweeps expired checkpoints periodically, and stops on SIGINT or SIGTERM. Logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import logging
import signal

from lathe.runtime.probes import add_metrics_port, serve_metrics
from lathe.runtime.serving import READY_MARK, setup_logging

from .server import serve

NAME = "lathe.checkpoints"
MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def return_large_buffers() -> None:
    """Make every allocation of ``MMAP_THRESHOLD_BYTES`` or more its own mapping, unmapped when freed.

    This server moves a checkpoint through 256 KiB chunks (from the arenas, reused as they are freed) and, on S3,
    16 MiB upload parts on many threads. glibc's default raises its mmap threshold after the first large free, so
    later parts come from per-thread arenas that keep what they freed: the resident set then grew with the
    checkpoint's size and the threads' number instead of with what is in flight. A fixed threshold turns that off.
    No-op where the C library has no ``mallopt``."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


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
    logging.getLogger(NAME).info("stopped")


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
    setup_logging()
    return_large_buffers()
    asyncio.run(_run(args))


if __name__ == "__main__":
    main()
