"""``python -m lathe.gateway``: the public endpoint, the gRPC door and (``--http-port``) the Tinker HTTP door.

Both doors serve one ``GatewayCore`` in one event loop. With ``--http-port`` the HTTP door starts first and
prints ``lathe.gateway http listening on HOST:PORT``; then the gRPC door prints the gateway's ready line
``lathe.gateway listening on HOST:PORT``.
"""

from __future__ import annotations

import argparse
import asyncio

from lathe.serving import READY_MARK, serve_until_stopped
from lathe.v1 import lathe_pb2_grpc as pb_grpc

from .auth import ApiKeys
from .core import GatewayCore
from .http_server import HttpServer
from .server import GatewayServicer
from .tinker_http import TinkerHttpDoor


async def serve(args: argparse.Namespace) -> None:
    keys = ApiKeys.parse(args.api_keys)
    core = GatewayCore(args.trainer, args.checkpoints, args.sampler)
    http = None
    if args.http_port >= 0:
        http = await HttpServer.start(TinkerHttpDoor(core, keys).app(), args.host, args.http_port)
        print(f"lathe.gateway http{READY_MARK}{args.host}:{http.port}", flush=True)

    async def stop() -> None:
        if http is not None:
            await http.stop()
        await core.close()

    await serve_until_stopped("lathe.gateway", args.host, args.port,
                              lambda server: pb_grpc.add_GatewayServicer_to_server(GatewayServicer(core, keys), server),
                              on_stop=stop)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m lathe.gateway")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    ap.add_argument("--http-port", type=int, default=-1,
                    help="serve the Tinker HTTP API (/api/v1) on this port (0: any free port, -1: off)")
    ap.add_argument("--trainer", required=True, help="address of the trainer pool")
    ap.add_argument("--checkpoints", required=True, help="address of the checkpoints service")
    ap.add_argument("--sampler", required=True, help="address of the sampler pool")
    ap.add_argument("--api-keys", default="", help="KEY=TENANT,... (empty: each key is its own tenant)")
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
