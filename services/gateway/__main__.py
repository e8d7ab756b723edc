"""``python -m lathe.gateway``: the public endpoint, the gRPC door and (``--http-port``) the Tinker HTTP door.

Both doors serve one ``GatewayCore`` in one event loop. With ``--http-port`` the HTTP door starts first and
prints ``lathe.gateway http listening on HOST:PORT``; then the gRPC door prints the gateway's ready line
``lathe.gateway listening on HOST:PORT``. The ``--max-*`` flags set what one request may ask for
(``limits.RequestLimits``; a gRPC message and an HTTP body alike are capped at ``--max-message-bytes``) and what
decoding one HTTP body may cost (``limits.HttpLimits``).
API keys come from ``--api-keys-file`` (``auth.ApiKeys``; without one, open mode on loopback only, said on
stderr at start); ``--tls-cert`` and ``--tls-key`` put both doors behind TLS (``tls.TlsFiles``). The internal
services are called with the stack's shared secret (``lathe.runtime.internal_auth``). Per-tenant quotas come from
``--quotas`` (``quotas.QuotaConfig``; without it, the defaults); ``--keep-result-bytes`` bounds the finished
results kept in memory (``futures``). The control plane (sessions, runs, the
ledger of operations) lives in the database at ``--db`` (``store.ControlStore``; default: a SQLite file in the
cache directory); at start the gateway migrates it, loads it and sends the operations still pending on again,
before it prints its ready lines. ``--metrics-port`` serves Prometheus metrics (``metrics``, ``lathe.runtime.probes``);
the gRPC door answers ``grpc.health.v1`` (ready while the database answers). The trainer and sampler pools come
from ``--discovery`` (``discovery``):
``static``, the one pool at ``--trainer`` and ``--sampler``, or ``kubernetes``, the pools whose EndpointSlices
in ``--discovery-namespace`` match ``--discovery-selector`` (``kube_discovery``), followed as they come and go.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from starlette.applications import Starlette
from starlette.routing import Mount

from lathe.runtime.options import add_options, options
from lathe.runtime.probes import Probes, add_metrics_port, serve_metrics
from lathe.runtime.serving import READY_MARK, serve_until_stopped, setup_logging
from lathe.v1 import lathe_pb2_grpc as pb_grpc

from .auth import KEYS_FILE_ENV, ApiKeys
from .config import GatewayConfig
from .console import Console
from .core import GatewayCore
from .discovery import make_directory
from .http_server import HttpServer
from .limits import DecodeGate
from .metrics import GatewayMetrics
from .openai_http import PREFIX as OPENAI_PREFIX
from .openai_http import OpenAiApi
from .quotas import QuotaConfig, Quotas
from .server import GateDecodes, GatewayServicer, RequireApiKey
from .store import ControlStore
from .tinker_http import TinkerHttpApi
from .tinker_io import PREFIX
from .tls import TlsFiles

log = logging.getLogger("lathe.gateway")


def _store_answers(store: ControlStore) -> bool:
    """The gateway's readiness: its control-plane database answers a read (liveness: its event loop answers)."""
    store.get_session("")
    return True


async def serve(cfg: GatewayConfig, args: argparse.Namespace) -> None:
    """Serve ``cfg`` on ``args.host`` and ``args.port`` (and /metrics on ``args.metrics_port``) until SIGTERM."""
    keys = ApiKeys.from_file(cfg.api_keys_file)
    keys.require_safe(args.host)
    if keys.open_mode:
        log.warning("OPEN MODE, no API keys configured: every key is its own tenant (loopback only; give "
                    "--api-keys-file or %s to name tenants)", KEYS_FILE_ENV)
    tls = TlsFiles.from_args(cfg.tls_cert, cfg.tls_key)
    limits, http_limits = cfg.limits, cfg.http_limits
    quotas = Quotas(QuotaConfig.from_file(cfg.quotas))
    store = ControlStore(cfg.store)
    metrics = GatewayMetrics(tenant_labels=cfg.metrics_tenant_labels)
    probes = Probes("lathe.v1.Gateway", "lathe_gateway", ready=lambda: _store_answers(store),
                    registry=metrics.registry)
    pools = make_directory(cfg.discovery)
    await asyncio.to_thread(pools.start)
    core = GatewayCore(cfg.discovery.trainer, cfg.checkpoints, cfg.discovery.sampler, limits, quotas=quotas,
                       store=store, calls=cfg.calls, pools=pools, metrics=metrics,
                       keep_result_bytes=cfg.keep_result_bytes, session_idle_s=cfg.session_idle_s)
    resumed = core.restore()
    if resumed:
        log.info("resumed %d operations pending in %r", resumed, store.engine.url)
    if args.metrics_port >= 0:
        serve_metrics("lathe.gateway", probes.registry, args.host, args.metrics_port)
    http, tinker, files_url = None, None, ""
    gate = DecodeGate(http_limits.max_concurrent_decodes)  # both doors' large requests, decoded a few at a time
    if cfg.http_port >= 0:
        tinker = TinkerHttpApi(core, keys, http_limits=http_limits, public_url=cfg.http_public_url, gate=gate)
        openai = OpenAiApi(core, keys, tinker.bodies.fields)
        console = Console(core, keys, tinker.downloads.signer)
        app = Starlette(routes=[Mount(OPENAI_PREFIX, app=openai.app()), *console.routes(), Mount("", app=tinker.app())])
        http = await HttpServer.start(app, args.host, cfg.http_port, tls)
        print(f"lathe.gateway http{READY_MARK}{args.host}:{http.port}", flush=True)
        root = cfg.http_public_url.rstrip("/") or f"{'https' if tls else 'http'}://{args.host}:{http.port}"
        files_url = root + PREFIX
    servicer = GatewayServicer(core, keys, tinker.downloads if tinker is not None else None, files_url,
                               files_url.removesuffix(PREFIX))

    async def stop() -> None:
        if http is not None:
            await http.stop()
        await core.close()
        await asyncio.to_thread(pools.close)
        store.close()

    await serve_until_stopped("lathe.gateway", args.host, args.port,
                              lambda server: pb_grpc.add_GatewayServicer_to_server(servicer, server),
                              on_stop=stop, max_receive_bytes=limits.max_message_bytes,
                              interceptors=[RequireApiKey(keys), GateDecodes(gate)],
                              credentials=tls.grpc_credentials() if tls else None, probes=probes)


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(prog="python -m lathe.gateway")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    add_metrics_port(ap)
    add_options(ap, GatewayConfig)
    args = ap.parse_args()
    asyncio.run(serve(options(args, GatewayConfig, ap), args))


if __name__ == "__main__":
    main()
