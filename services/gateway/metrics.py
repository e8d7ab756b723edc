"""The gateway's Prometheus metrics: the Tinker HTTP door's requests, and per-tenant usage.

Owned by ``GatewayCore`` (``core.metrics``), shared by both doors; the process's ``Probes`` serve the same registry,
where the gRPC door's calls are counted too (``lathe_gateway_grpc_*``, by ``lathe.runtime.probes.RequestMetrics``).

- HTTP door (``timed`` wraps each route's endpoint): ``lathe_gateway_http_requests_total{route,status}``,
  ``lathe_gateway_http_request_seconds{route}``, ``lathe_gateway_http_requests_in_flight``; ``route`` is the
  handler's name (a fixed set), ``status`` the HTTP status code.
- usage, recorded as each operation's result is recorded (``finished``): ``lathe_gateway_operations_total``
  ``{tenant,op,outcome}`` and ``lathe_gateway_tenant_tokens_total{tenant,op}`` (the tokens of its receipt).
  Tenants are a bounded label set (``lathe.runtime.probes.TenantLabels``: past the cap they count as "other"), and by
  default an empty one (``tenant_labels`` 0, ``--metrics-tenant-labels``): every tenant is "other", since tenant
  names and their usage are the operator's customers' data, not the scraper's.
- the pools at a glance, for the console (``pools``): the receipts of the training operations finished in the last
  ``POOL_WINDOW_S``, every tenant's, summed per pool without naming anyone.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.requests import Request
from starlette.responses import Response

from lathe.runtime.probes import LATENCY_BUCKETS, TenantLabels
from lathe.v1 import lathe_pb2 as pb

Endpoint = Callable[[Request], Awaitable[Response]]
POOL_WINDOW_S = 300.0  # the console's pool figures cover this much of the recent past
TRAINING_OPS = ("forward_backward", "optim_step")


@dataclass(frozen=True, slots=True)
class PoolFigures:
    """The trainer pools over the last ``window_s``: clock cycles run, their mean length, the share of the window
    they filled, the mean wait of an operation before its cycle, and the operations not finished now."""

    window_s: float
    cycles: int
    mean_cycle_s: float
    utilization: float
    mean_queued_s: float
    pending: int


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, tenant_labels: int = 0) -> None:
        """``tenant_labels``: how many tenants (the first seen) are named in the usage metrics' ``tenant`` label."""
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.tenant = TenantLabels(tenant_labels)
        self.http_requests = Counter("lathe_gateway_http_requests", "Tinker HTTP requests by route and status",
                                     ["route", "status"], registry=r)
        self.http_seconds = Histogram("lathe_gateway_http_request_seconds", "Tinker HTTP request latency by route",
                                      ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.http_in_flight = Gauge("lathe_gateway_http_requests_in_flight", "Tinker HTTP requests being answered",
                                    registry=r)
        self.operations = Counter("lathe_gateway_operations", "Operations finished, by tenant, kind and outcome",
                                  ["tenant", "op", "outcome"], registry=r)
        self.tenant_tokens = Counter("lathe_gateway_tenant_tokens", "Tokens of finished operations, by tenant",
                                     ["tenant", "op"], registry=r)
        self._recent: deque[tuple[float, tuple[str, int], float, float]] = deque()  # finished, cycle, run_s, queued_s

    def timed(self, route: str, endpoint: Endpoint) -> Endpoint:
        """``endpoint``, counted and timed under ``route``."""

        async def counted(request: Request) -> Response:
            started = time.perf_counter()
            self.http_in_flight.inc()
            status = 500
            try:
                response = await endpoint(request)
                status = response.status_code
                return response
            finally:
                self.http_in_flight.dec()
                self.http_requests.labels(route=route, status=str(status)).inc()
                self.http_seconds.labels(route=route).observe(time.perf_counter() - started)

        return counted

    def finished(self, tenant: str, result: pb.FutureResult) -> None:
        """Count one finished operation of ``tenant`` and the tokens its receipt says it used."""
        who, op = self.tenant(tenant), result.receipt.op or "other"
        self.operations.labels(tenant=who, op=op, outcome="error" if result.HasField("error") else "ok").inc()
        self.tenant_tokens.labels(tenant=who, op=op).inc(result.receipt.tokens)
        if op in TRAINING_OPS and not result.HasField("error"):
            r = result.receipt
            self._recent.append((time.monotonic(), (r.fingerprint, r.cycle), r.run_s, r.queued_s))

    def pools(self, pending: int, window_s: float = POOL_WINDOW_S) -> PoolFigures:
        """The training operations finished in the last ``window_s`` as ``PoolFigures`` (``pending``: the ledger's
        unfinished operations, every tenant's)."""
        cut = time.monotonic() - window_s
        while self._recent and self._recent[0][0] < cut:
            self._recent.popleft()
        cycles = {cycle: run_s for _, cycle, run_s, _ in self._recent}  # a cycle's operations share its run_s
        busy = sum(cycles.values())
        queued = [q for *_, q in self._recent]
        return PoolFigures(window_s, len(cycles), busy / len(cycles) if cycles else 0.0, min(1.0, busy / window_s),
                           sum(queued) / len(queued) if queued else 0.0, pending)
