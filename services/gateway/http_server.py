"""Serving an ASGI app with uvicorn inside the gateway's own event loop, beside its gRPC server.

The gateway process owns SIGINT/SIGTERM (``lathe.runtime.serving``), so this server installs no signal handlers;
it is started after binding its socket (port 0 picks a free one) and stopped by ``stop()``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp

from lathe.runtime.serving import http_listener

from .tls import TlsFiles

GRACE_S = 2.0  # how long stop() lets open requests (long-polls included) finish
KEEP_ALIVE_S = 75  # idle connections stay open longer than the SDK's 10 s heartbeat, so its pool reuses them


class _Embedded(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # signals stay with the gateway process


class HttpServer:
    """``await HttpServer.start(app, host, port, tls)``; ``port`` is the bound one; HTTPS when ``tls`` is given."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None], port: int) -> None:
        self._server, self._task, self.port = server, task, port

    @classmethod
    async def start(cls, app: ASGIApp, host: str, port: int, tls: TlsFiles | None = None) -> HttpServer:
        sock = http_listener(host, port)
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                                timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=int(GRACE_S),
                                ssl_certfile=tls and tls.cert, ssl_keyfile=tls and tls.key)
        server = _Embedded(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()  # raises why it could not start
                raise RuntimeError("the HTTP server stopped before it started")
            await asyncio.sleep(0.01)
        return cls(server, task, sock.getsockname()[1])

    async def stop(self) -> None:
        self._server.should_exit = True
        await self._task
