"""How every Lathe service process runs its gRPC server (torch-free).

``run(name, host, port, add_servicers)`` starts a ``grpc.aio`` server on ``host:port`` (port 0 picks
a free port), prints exactly one ready line ``<name> listening on HOST:PORT`` (``lathe serve`` and the
tests wait for it), and serves until SIGINT or SIGTERM, then stops gracefully. ``run`` serves internal
services: it installs the shared-secret check of ``lathe.runtime.internal_auth``. Internal services take
messages up to ``lathe.channels.MAX_MESSAGE_BYTES`` (checkpoint bytes travel through them); the public gateway passes
its own, much smaller ``max_receive_bytes``, and its TLS ``credentials`` when it has a certificate. Given the
service's ``Probes`` (``lathe.runtime.probes``), the server also answers gRPC health and counts its calls.
``http_listener`` binds the socket a service's HTTP server (uvicorn) is handed.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence

import grpc

from lathe.channels import MAX_MESSAGE_BYTES
from lathe.runtime.internal_auth import server_interceptors
from lathe.runtime.probes import Probes

READY_MARK = " listening on "


async def serve_until_stopped(
    name: str,
    host: str,
    port: int,
    add_servicers: Callable[[grpc.aio.Server], None],
    on_stop: Callable[[], Awaitable[None] | None] | None = None,
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    probes: Probes | None = None,
) -> None:
    if probes is not None:
        interceptors = [probes.requests, *interceptors]
    server = grpc.aio.server(interceptors=interceptors,
                             options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_receive_message_length", max_receive_bytes)])
    add_servicers(server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if probes is not None:
        probes.install(server)
        await probes.start()
    await server.start()
    print(f"{name}{READY_MARK}{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if probes is not None:
        await probes.shutdown()
    await server.stop(grace=2.0)
    if on_stop is not None:
        res = on_stop()
        if res is not None:
            await res
    logging.getLogger(name).info("stopped")


LOG_FORMAT = "%(asctime)s %(name)s %(message)s"


def http_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0 picks a free one) for an asyncio HTTP server.

    Made with protocol ``IPPROTO_TCP``, not ``socket.create_server``'s 0: asyncio turns Nagle's algorithm off
    (``TCP_NODELAY``) only on accepted sockets whose protocol says TCP. With it on, a response written as headers
    then body waits for the client's delayed ACK of the headers: every request on a kept-alive connection took
    44 ms on loopback (the first on a new connection 1.7 ms), and the official SDK keeps its connections alive.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


def setup_logging() -> None:
    """Every service's one logging setup: to stderr as ``<time> <logger> <message>``, INFO and up from Lathe's
    ``lathe.<service>`` loggers, WARNING and up from libraries (stdout carries only the ready and metrics lines
    ``lathe.stack`` reads)."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=LOG_FORMAT)
    logging.getLogger("lathe").setLevel(logging.INFO)


def run(name: str, host: str, port: int, add_servicers: Callable[[grpc.aio.Server], None],
        on_stop: Callable[[], Awaitable[None] | None] | None = None, probes: Probes | None = None) -> None:
    """Serve an internal service: only callers holding the stack's secret get through (health probes excepted)."""
    asyncio.run(serve_until_stopped(name, host, port, add_servicers, on_stop,
                                    interceptors=server_interceptors(name, host), probes=probes))
