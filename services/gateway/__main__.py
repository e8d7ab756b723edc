"""``python -m lathe.gateway``: the public endpoint, the gRPC door and (``--http-port``) the Tinker HTTP door.

Both doors serve one ``GatewayCore`` in one event loop. With ``--http-port`` the HTTP door starts first and
prints ``lathe.gateway http listening on HOST:PORT``; then the gRPC door prints the gateway's ready line
``lathe.gateway listening on HOST:PORT``. The ``--max-*`` flags set what one request may ask for
(``limits.DoorLimits``; a gRPC message and an HTTP body alike are capped at ``--max-message-bytes``) and what
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
import os
from urllib.parse import urlparse

from lathe.runtime.options import add_options, options
from lathe.runtime.probes import Probes, add_metrics_port, serve_metrics
from lathe.runtime.serving import READY_MARK, serve_until_stopped, setup_logging
from lathe.v1 import lathe_pb2_grpc as pb_grpc

from .auth import KEYS_FILE_ENV, ApiKeys
from .calls import CallPolicy
from .core import GatewayCore
from .discovery import DIRECTORIES, DiscoveryConfig, make_directory
from .futures import KEEP_DONE_BYTES
from .http_server import HttpServer
from .limits import DecodeGate, DoorLimits, HttpLimits
from .metrics import GatewayMetrics
from .quotas import QuotaConfig, Quotas
from .server import GateDecodes, GatewayServicer, RequireApiKey
from .sessions import SESSION_IDLE_S
from .store import ControlStore, StoreConfig
from .tinker_http import PREFIX, TinkerHttpDoor
from .tls import TlsFiles

log = logging.getLogger("lathe.gateway")

DEFAULT_DB = "sqlite:///.cache/lathe/control.db"
DB_ENV = "LATHE_DB_URL"  # the database URL from the environment: a password stays out of argv


def _store_answers(store: ControlStore) -> bool:
    """The gateway's readiness: its control-plane database answers a read (liveness: its event loop answers)."""
    store.get_session("")
    return True


async def serve(args: argparse.Namespace) -> None:
    keys = ApiKeys.from_file(args.api_keys_file)
    keys.require_safe(args.host)
    if keys.open_mode:
        log.warning("OPEN MODE, no API keys configured: every key is its own tenant (loopback only; give "
                    "--api-keys-file or %s to name tenants)", KEYS_FILE_ENV)
    tls = TlsFiles.from_args(args.tls_cert, args.tls_key)
    limits, http_limits = options(args, DoorLimits), options(args, HttpLimits)
    quotas = Quotas(QuotaConfig.from_file(args.quotas))
    store = ControlStore(StoreConfig(args.db, retention_s=args.ledger_retention_s, keep_done=args.ledger_keep))
    metrics = GatewayMetrics(tenant_labels=args.metrics_tenant_labels)
    probes = Probes("lathe.v1.Gateway", "lathe_gateway", ready=lambda: _store_answers(store),
                    registry=metrics.registry)
    pools = make_directory(DiscoveryConfig(args.discovery, args.trainer, args.sampler, args.discovery_namespace,
                                           args.discovery_selector))
    await asyncio.to_thread(pools.start)
    core = GatewayCore(args.trainer, args.checkpoints, args.sampler, limits, quotas=quotas, store=store,
                       calls=CallPolicy(retry_budget_s=args.retry_budget_s), pools=pools, metrics=metrics,
                       keep_result_bytes=args.keep_result_bytes, session_idle_s=args.session_idle_s)
    resumed = core.restore()
    if resumed:
        log.info("resumed %d operations pending in %r", resumed, store.engine.url)
    if args.metrics_port >= 0:
        serve_metrics("lathe.gateway", probes.registry, args.host, args.metrics_port)
    http, door, files_url = None, None, ""
    gate = DecodeGate(http_limits.max_concurrent_decodes)  # both doors' large requests, decoded a few at a time
    if args.http_port >= 0:
        door = TinkerHttpDoor(core, keys, http_limits=http_limits, public_url=args.http_public_url, gate=gate)
        http = await HttpServer.start(door.app(), args.host, args.http_port, tls)
        print(f"lathe.gateway http{READY_MARK}{args.host}:{http.port}", flush=True)
        root = args.http_public_url.rstrip("/") or f"{'https' if tls else 'http'}://{args.host}:{http.port}"
        files_url = root + PREFIX
    servicer = GatewayServicer(core, keys, door.downloads if door is not None else None, files_url)

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


def _public_url(text: str) -> str:
    """``--http-public-url``: empty, or an http(s) URL with a host (a path is kept: a door served under one)."""
    url = urlparse(text)
    if text and (url.scheme not in ("http", "https") or not url.netloc or url.query or url.fragment):
        raise argparse.ArgumentTypeError(f"{text!r} is not http(s)://host[:port][/path]")
    return text


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(prog="python -m lathe.gateway")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    ap.add_argument("--http-port", type=int, default=-1,
                    help="serve the Tinker HTTP API (/api/v1) on this port (0: any free port, -1: off)")
    ap.add_argument("--http-public-url", default="", type=_public_url,
                    help="the HTTP door's root as clients reach it (e.g. https://lathe.example.com behind an "
                         "Ingress), for the download URLs both doors sign (default: the gRPC door the scheme, --host "
                         "and the HTTP port; the HTTP door the scheme and host each request arrived with)")
    discovery = DiscoveryConfig()
    ap.add_argument("--discovery", choices=sorted(DIRECTORIES), default=discovery.kind,
                    help="how the trainer and sampler pools are found (default %(default)s: --trainer, --sampler)")
    ap.add_argument("--trainer", default="", help="static discovery: address of the trainer pool")
    ap.add_argument("--checkpoints", required=True, help="address of the checkpoints service")
    ap.add_argument("--sampler", default="", help="static discovery: address of the sampler pool")
    ap.add_argument("--discovery-namespace", default=discovery.namespace,
                    help="kubernetes discovery: the namespace of the pools' EndpointSlices")
    ap.add_argument("--discovery-selector", default=discovery.selector,
                    help="kubernetes discovery: label selector of the pools' EndpointSlices (default %(default)s)")
    ap.add_argument("--api-keys-file", default=os.environ.get(KEYS_FILE_ENV, ""),
                    help="file of KEY=TENANT lines (default: $LATHE_API_KEYS_FILE; none: open mode, loopback only)")
    ap.add_argument("--tls-cert", default="", help="PEM certificate for both public doors (with --tls-key)")
    ap.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    store_defaults, call_defaults = StoreConfig(), CallPolicy()
    ap.add_argument("--db", default=os.environ.get(DB_ENV, DEFAULT_DB),
                    help=f"the control plane's database: sqlite:///FILE, postgresql+psycopg://... or sqlite:// "
                         f"(in memory: forgotten at exit) (default ${DB_ENV}, else {DEFAULT_DB})")
    ap.add_argument("--ledger-retention-s", type=float, default=store_defaults.retention_s,
                    help="how long finished operations' results are kept (default %(default)s)")
    ap.add_argument("--ledger-keep", type=int, default=store_defaults.keep_done,
                    help="at most this many finished operations' results are kept (default %(default)s)")
    ap.add_argument("--keep-result-bytes", type=int, default=KEEP_DONE_BYTES,
                    help="finished results kept in memory, in bytes, oldest dropped first (an older one is read "
                         "from the ledger while it holds it) (default %(default)s)")
    ap.add_argument("--retry-budget-s", type=float, default=call_defaults.retry_budget_s,
                    help="how long an idempotent internal call waits for its service to come back "
                         "(default %(default)s)")
    ap.add_argument("--session-idle-s", type=float, default=SESSION_IDLE_S,
                    help="a session not heard from this long (no heartbeat; both SDKs send one every 10 s) is "
                         "finished when its tenant next opens a session or sampling session (default %(default)s)")
    add_metrics_port(ap)
    ap.add_argument("--metrics-tenant-labels", type=int, default=0,
                    help="name this many tenants in the usage metrics' tenant label (default 0: every tenant is "
                         "'other')")
    ap.add_argument("--quotas", default="", help="per-tenant quotas, a JSON or .toml file (quotas.QuotaConfig)")
    add_options(ap, DoorLimits)
    add_options(ap, HttpLimits)
    args = ap.parse_args()
    if not args.session_idle_s > 0:
        ap.error(f"--session-idle-s must be > 0, got {args.session_idle_s}")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
