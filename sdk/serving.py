"""How every Lathe service process runs its gRPC server (torch-free; shared by all rooms).

``run(name, host, port, add_servicers)`` starts a ``grpc.aio`` server on ``host:port`` (port 0 picks
a free port), prints exactly one ready line ``<name> listening on HOST:PORT`` (``lathe serve`` and the
tests wait for it), and serves until SIGINT or SIGTERM, then stops gracefully.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable

import grpc

MAX_MESSAGE_BYTES = 1 << 30
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

READY_MARK = " listening on "


async def serve_until_stopped(
    name: str,
    host: str,
    port: int,
    add_servicers: Callable[[grpc.aio.Server], None],
    on_stop: Callable[[], Awaitable[None] | None] | None = None,
) -> None:
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    add_servicers(server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    print(f"{name}{READY_MARK}{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2.0)
    if on_stop is not None:
        res = on_stop()
        if res is not None:
            await res
    print(f"{name} stopped", file=sys.stderr, flush=True)


def run(name: str, host: str, port: int, add_servicers: Callable[[grpc.aio.Server], None],
        on_stop: Callable[[], Awaitable[None] | None] | None = None) -> None:
    asyncio.run(serve_until_stopped(name, host, port, add_servicers, on_stop))
