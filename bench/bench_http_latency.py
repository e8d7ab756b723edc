"""Latency of one HTTP request on a kept-alive connection, as the official SDK (httpx) sends them.

    python bench/bench_http_latency.py [--requests 200]

Two measurements, one process run:
- the same small JSON app served by uvicorn twice in this process, from a listener made by
  ``socket.create_server`` (protocol 0: asyncio leaves Nagle's algorithm on for what it accepts, so a response's
  body waits for the client's delayed ACK of its headers) and from ``lathe.runtime.serving.http_listener`` (what
  the gateway and the SGLang API serve from); the ratio is what the listener is worth per request;
- the real gateway of a tiny-model stack: ``GET /api/v1/get_server_capabilities`` and a refused
  ``POST /api/v1/get_info`` (a lookup that reaches the gateway's core), on one kept-alive connection.
The floor is the loopback round trip of a raw socket (a byte there and back).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import uvicorn
from machine import cpu_line
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from lathe.runtime.serving import http_listener
from lathe.stack import Stack, StackConfig

REPO = Path(__file__).resolve().parents[1]


def median_ms(call: Callable[[], object], n: int) -> float:
    call()  # the connection opened
    times = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def serve(sock: socket.socket) -> uvicorn.Server:
    """A small JSON app on ``sock`` in a thread of its own; stopped by ``should_exit``."""
    app = Starlette(routes=[Route("/caps", lambda _: JSONResponse({"models": ["m"] * 20, "limits": {"x": 1}}))])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server


def loopback_ms(n: int) -> float:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname()[:2])
        peer, _ = listener.accept()
        for s in (client, peer):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def echo() -> None:
            client.sendall(b"x")
            peer.recv(1)
            peer.sendall(b"y")
            client.recv(1)

        try:
            return median_ms(echo, n)
        finally:
            client.close()
            peer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    print(f"median of {args.requests} requests on one kept-alive httpx connection; {cpu_line()}")
    rows = {}
    for label, sock in (("socket.create_server", socket.create_server(("127.0.0.1", 0))),
                        ("http_listener", http_listener("127.0.0.1", 0))):
        server = serve(sock)
        host, port = sock.getsockname()[:2]
        with httpx.Client(base_url=f"http://{host}:{port}") as c:
            rows[label] = median_ms(lambda c=c: c.get("/caps"), args.requests)
        server.should_exit = True
    for label, ms in rows.items():
        print(f"{'small app, ' + label:<44}{ms:>8.2f} ms")
    print(f"{'ratio':<44}{rows['socket.create_server'] / rows['http_listener']:>8.1f}x")
    cfg = StackConfig(models="lathe/tiny-llama", store_root=REPO / ".cache" / "bench-store-http",
                      cache_root=REPO / ".cache" / "lathe", trainer_threads=1, sampler_threads=1)
    with Stack(cfg) as stack, httpx.Client(base_url=f"{stack.http_url}/api/v1",
                                           headers={"X-API-Key": "tml-bench"}) as c:
        get = median_ms(lambda: c.get("/get_server_capabilities"), args.requests)
        post = median_ms(lambda: c.post("/get_info", json={"model_id": "no-such-run"}), args.requests)
    print(f"{'gateway GET /get_server_capabilities':<44}{get:>8.2f} ms")
    print(f"{'gateway POST /get_info (refused lookup)':<44}{post:>8.2f} ms")
    print(f"{'floor: a loopback round trip':<44}{loopback_ms(args.requests):>8.3f} ms")


if __name__ == "__main__":
    main()
