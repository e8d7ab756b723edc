"""``python -m lathe.gateway``: the public endpoint (gRPC door)."""

from __future__ import annotations

import argparse

from lathe.serving import run
from lathe.v1 import lathe_pb2_grpc as pb_grpc

from .auth import ApiKeys
from .core import GatewayCore
from .server import GatewayServicer


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m lathe.gateway")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--trainer", required=True, help="address of the trainer pool")
    ap.add_argument("--checkpoints", required=True, help="address of the checkpoints service")
    ap.add_argument("--sampler", required=True, help="address of the sampler pool")
    ap.add_argument("--api-keys", default="", help="KEY=TENANT,... (empty: each key is its own tenant)")
    args = ap.parse_args()
    keys = ApiKeys.parse(args.api_keys)
    holder: dict[str, GatewayCore] = {}

    def add(server) -> None:  # noqa: ANN001 - grpc.aio.Server
        holder["core"] = GatewayCore(args.trainer, args.checkpoints, args.sampler)
        pb_grpc.add_GatewayServicer_to_server(GatewayServicer(holder["core"], keys), server)

    run("lathe.gateway", args.host, args.port, add, on_stop=lambda: holder["core"].close())


if __name__ == "__main__":
    main()
