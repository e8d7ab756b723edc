"""``python -m lathe.gateway``: the public endpoint, the gRPC door and (``--http-port``) the Tinker HTTP door.

Both doors serve one ``GatewayCore`` in one event loop. With ``--http-port`` the HTTP door starts first and
prints ``lathe.gateway http listening on HOST:PORT``; then the gRPC door prints the gateway's ready line
``lathe.gateway listening on HOST:PORT``. The ``--max-*`` flags set what one request may ask for
(``limits.DoorLimits``; a gRPC message and an HTTP body alike are capped at ``--max-message-bytes``).
API keys come from ``--api-keys-file`` (``auth.ApiKeys``; without one, open mode on loopback only, said on
stderr at start); ``--tls-cert`` and ``--tls-key`` put both doors behind TLS (``tls.TlsFiles``). The internal
services are called with the stack's shared secret (``lathe.internal_auth``). Per-tenant quotas come from
``--quotas`` (``quotas.QuotaConfig``; without it, the defaults). The control plane (sessions, runs, the
ledger of operations) lives in the database at ``--db`` (``store.ControlStore``; default: a SQLite file in the
cache directory); at start the gateway migrates it, loads it and sends the operations still pending on again,
before it prints its ready lines.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import fields

from lathe.serving import READY_MARK, serve_until_stopped
from lathe.v1 import lathe_pb2_grpc as pb_grpc

from .auth import KEYS_FILE_ENV, ApiKeys
from .calls import CallPolicy
from .core import GatewayCore
from .http_server import HttpServer
from .limits import DoorLimits
from .quotas import QuotaConfig, Quotas
from .server import GatewayServicer
from .store import ControlStore, StoreConfig
from .tinker_http import TinkerHttpDoor
from .tls import TlsFiles

DEFAULT_DB = "sqlite:///.cache/lathe/control.db"


async def serve(args: argparse.Namespace) -> None:
    keys = ApiKeys.from_file(args.api_keys_file)
    keys.require_safe(args.host)
    if keys.open_mode:
        print(f"lathe.gateway: OPEN MODE, no API keys configured: every key is its own tenant (loopback only; "
              f"give --api-keys-file or {KEYS_FILE_ENV} to name tenants)", file=sys.stderr, flush=True)
    tls = TlsFiles.from_args(args.tls_cert, args.tls_key)
    limits = DoorLimits(**{f.name: getattr(args, f.name) for f in fields(DoorLimits)})
    quotas = Quotas(QuotaConfig.from_file(args.quotas))
    store = ControlStore(StoreConfig(args.db, retention_s=args.ledger_retention_s, keep_done=args.ledger_keep))
    core = GatewayCore(args.trainer, args.checkpoints, args.sampler, limits, quotas=quotas, store=store,
                       calls=CallPolicy(retry_budget_s=args.retry_budget_s))
    resumed = core.restore()
    if resumed:
        print(f"lathe.gateway: resumed {resumed} operations pending in {store.engine.url!r}", file=sys.stderr,
              flush=True)
    http = None
    if args.http_port >= 0:
        http = await HttpServer.start(TinkerHttpDoor(core, keys).app(), args.host, args.http_port, tls)
        print(f"lathe.gateway http{READY_MARK}{args.host}:{http.port}", flush=True)

    async def stop() -> None:
        if http is not None:
            await http.stop()
        await core.close()
        store.close()

    await serve_until_stopped("lathe.gateway", args.host, args.port,
                              lambda server: pb_grpc.add_GatewayServicer_to_server(GatewayServicer(core, keys), server),
                              on_stop=stop, max_receive_bytes=limits.max_message_bytes,
                              credentials=tls.grpc_credentials() if tls else None)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m lathe.gateway")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    ap.add_argument("--http-port", type=int, default=-1,
                    help="serve the Tinker HTTP API (/api/v1) on this port (0: any free port, -1: off)")
    ap.add_argument("--trainer", required=True, help="address of the trainer pool")
    ap.add_argument("--checkpoints", required=True, help="address of the checkpoints service")
    ap.add_argument("--sampler", required=True, help="address of the sampler pool")
    ap.add_argument("--api-keys-file", default=os.environ.get(KEYS_FILE_ENV, ""),
                    help="file of KEY=TENANT lines (default: $LATHE_API_KEYS_FILE; none: open mode, loopback only)")
    ap.add_argument("--tls-cert", default="", help="PEM certificate for both public doors (with --tls-key)")
    ap.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    store_defaults, call_defaults = StoreConfig(), CallPolicy()
    ap.add_argument("--db", default=DEFAULT_DB,
                    help=f"the control plane's database: sqlite:///FILE, postgresql+psycopg://... or sqlite:// "
                         f"(in memory: forgotten at exit) (default {DEFAULT_DB})")
    ap.add_argument("--ledger-retention-s", type=float, default=store_defaults.retention_s,
                    help="how long finished operations' results are kept (default %(default)s)")
    ap.add_argument("--ledger-keep", type=int, default=store_defaults.keep_done,
                    help="at most this many finished operations' results are kept (default %(default)s)")
    ap.add_argument("--retry-budget-s", type=float, default=call_defaults.retry_budget_s,
                    help="how long an idempotent internal call waits for its service to come back "
                         "(default %(default)s)")
    ap.add_argument("--quotas", default="", help="per-tenant quotas, a JSON or .toml file (quotas.QuotaConfig)")
    for f in fields(DoorLimits):
        ap.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default,
                        help=f"request limit (default {f.default})")
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
