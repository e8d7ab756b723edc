"""What every Lathe service shows the outside: gRPC health (readiness, liveness) and Prometheus metrics.

Torch-free; owned here, used by the four services' ``__main__`` and servers (through ``lathe.runtime.serving`` and the
checkpoints server). One ``Probes`` per process holds:

- the process's ``CollectorRegistry`` (each service adds its own metrics to it: ``lathe.<service>.metrics``),
  served on ``/metrics`` by ``serve_metrics`` (a prometheus-client HTTP thread on its own port);
- ``RequestMetrics``, a gRPC server interceptor counting every call by method and status code, with its
  latency and the calls in flight: ``<prefix>_grpc_requests_total{method,code}``,
  ``<prefix>_grpc_request_seconds{method}``, ``<prefix>_grpc_requests_in_flight``;
- the ``grpc.health.v1.Health`` service, answered under three names: ``""`` and the service's own name
  (e.g. ``lathe.v1.Trainer``) say readiness, ``"liveness"`` says liveness. Both start NOT_SERVING / SERVING
  respectively; ``watch`` polls the service's ``ready`` and ``alive`` callables every ``POLL_S`` (on a worker
  thread: a readiness check may do I/O) and sets the statuses; ``shutdown`` sets every name NOT_SERVING.

Health calls carry no secret (kubelet sends none): ``lathe.runtime.internal_auth`` lets them through (``OPEN_PREFIX``),
and they are not counted in the request metrics (probes would drown the traffic).

A pool (trainer, sampler) is ready once ``Warmup`` has loaded each served model (which runs its exactness
self-check) and its loop is alive; it is not alive once its loop died or a model failed to load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from lathe.runtime.internal_auth import OPEN_PREFIX

log = logging.getLogger("lathe.runtime.probes")

LIVENESS = "liveness"
POLL_S = 0.5
METRICS_MARK = " metrics on "
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def add_metrics_port(ap: argparse.ArgumentParser) -> None:
    """The ``--metrics-port`` flag every service takes (``serve_metrics``)."""
    ap.add_argument("--metrics-port", type=int, default=-1,
                    help="serve Prometheus /metrics on this port (0: any free port, -1: off)")


def serve_metrics(name: str, registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve ``registry`` on ``http://host:port/metrics`` (port 0: a free one) from a daemon thread; prints
    ``<name> metrics on http://HOST:PORT/metrics`` (``lathe.stack`` reads it) and returns the bound port."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_port)
    print(f"{name}{METRICS_MARK}http://{host}:{bound}/metrics", flush=True)
    return bound


class TenantLabels:
    """A bounded set of tenant label values: the first ``cap`` tenants seen keep their name, the rest are
    ``"other"`` (a metric's label set must not grow with the number of tenants)."""

    OTHER = "other"

    def __init__(self, cap: int = 50) -> None:
        self.cap = cap
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> str:
        with self._lock:
            if tenant in self._seen:
                return tenant
            if len(self._seen) < self.cap and tenant != self.OTHER:
                self._seen.add(tenant)
                return tenant
        return self.OTHER


class RequestMetrics(grpc.aio.ServerInterceptor):
    """Counts and times every gRPC call of a server by method name and final status code."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.requests = Counter(f"{prefix}_grpc_requests", "gRPC calls by method and status code",
                                ["method", "code"], registry=registry)
        self.seconds = Histogram(f"{prefix}_grpc_request_seconds", "gRPC call latency by method", ["method"],
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.in_flight = Gauge(f"{prefix}_grpc_requests_in_flight", "gRPC calls being answered", registry=registry)

    def _done(self, method: str, context: grpc.aio.ServicerContext, started: float, failed: bool) -> None:
        code = context.code()
        name = code.name if code is not None else ("UNKNOWN" if failed else "OK")
        self.requests.labels(method=method, code=name).inc()
        self.seconds.labels(method=method).observe(time.perf_counter() - started)
        self.in_flight.dec()

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIX):
            return handler
        method = details.method.rpartition("/")[2]
        if handler.unary_stream or handler.stream_stream:
            inner_stream = handler.unary_stream or handler.stream_stream

            async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
                started, failed = time.perf_counter(), True
                self.in_flight.inc()
                try:
                    async for message in inner_stream(request, context):
                        yield message
                    failed = False
                finally:
                    self._done(method, context, started, failed)

            make = (grpc.unary_stream_rpc_method_handler if handler.unary_stream
                    else grpc.stream_stream_rpc_method_handler)
            return make(streaming, handler.request_deserializer, handler.response_serializer)
        inner = handler.unary_unary or handler.stream_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started, failed = time.perf_counter(), True
            self.in_flight.inc()
            try:
                response = await inner(request, context)
                failed = False
                return response
            finally:
                self._done(method, context, started, failed)

        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
        return make(unary, handler.request_deserializer, handler.response_serializer)


def _always() -> bool:
    return True


class Probes:
    """One service's health and metrics (see the module docstring). ``service`` is its gRPC service name,
    ``prefix`` its metric prefix (``lathe_<service>``); ``ready`` and ``alive`` may block briefly. ``registry``:
    the one the service's own metrics live in (default: a new one)."""

    def __init__(self, service: str, prefix: str, ready: Callable[[], bool] = _always,
                 alive: Callable[[], bool] = _always, registry: CollectorRegistry | None = None) -> None:
        self.service, self.prefix = service, prefix
        self.ready, self.alive = ready, alive
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = RequestMetrics(self.registry, prefix)
        self.health = health_aio.HealthServicer()
        self._task: asyncio.Task[None] | None = None
        self._last_failure = ""

    def install(self, server: grpc.aio.Server) -> None:
        """Add the health service to ``server`` (before it starts); nothing is ready yet."""
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)

    async def start(self) -> None:
        """Set the initial statuses and start polling (call in the server's event loop once it serves)."""
        await self._set(ready=False, alive=True)
        self._task = asyncio.create_task(self.watch())

    async def _set(self, *, ready: bool, alive: bool) -> None:
        for name in ("", self.service):
            await self.health.set(name, SERVING if ready and alive else NOT_SERVING)
        await self.health.set(LIVENESS, SERVING if alive else NOT_SERVING)

    def _ask(self, check: Callable[[], bool]) -> bool:
        try:
            return bool(check())
        except Exception as e:  # noqa: BLE001 - a check that fails says "no"; why goes to the log, once
            why = f"{self.service} health check failed: {type(e).__name__}: {e}"
            if why != self._last_failure:
                log.warning(why)
            self._last_failure = why
            return False

    async def watch(self) -> None:
        """Poll ``ready`` and ``alive`` every ``POLL_S`` until cancelled."""
        while True:
            alive = await asyncio.to_thread(self._ask, self.alive)
            ready = alive and await asyncio.to_thread(self._ask, self.ready)
            await self._set(ready=ready, alive=alive)
            await asyncio.sleep(POLL_S)

    async def shutdown(self) -> None:
        """Stop polling and answer NOT_SERVING under every name from now on."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.health.enter_graceful_shutdown()


class Warmup:
    """Loads a model pool's served models on a background thread at start (``load(name)`` loads one and runs
    its exactness self-check: the engines' ``base``). ``ready`` once all loaded and ``pool_alive()``; ``alive``
    until the pool's loop died or a model failed to load (then the pod should be restarted)."""

    def __init__(self, load: Callable[[str], object], names: Iterable[str], pool_alive: Callable[[], bool]) -> None:
        self._load, self._names, self._pool_alive = load, list(names), pool_alive
        self._loaded = threading.Event()
        self.error: str | None = None

    def start(self) -> Warmup:
        threading.Thread(target=self._run, name="pool-warmup", daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            for name in self._names:
                self._load(name)
        except Exception as e:  # noqa: BLE001 - reported through liveness and the log
            self.error = f"{type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
            return
        self._loaded.set()

    def ready(self) -> bool:
        return self._loaded.is_set() and self.alive()

    def alive(self) -> bool:
        return self.error is None and self._pool_alive()
