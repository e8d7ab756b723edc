"""The Tinker HTTP front door: the official ``tinker`` SDK's protocol under ``/api/v1``, over ``GatewayCore``.

``TinkerHttpApi`` assembles the routes and wraps each handler: it authenticates the ``X-API-Key`` header through
``ApiKeys`` (Tinker's ``tml-`` keys) before the body is read, and answers a rejected call with the core error's
HTTP status and Tinker's ``{"error", "category"}`` body, never an empty one (429 with ``retry-after`` when waiting
helps). Each handler reads its body (``tinker_io.Bodies``), makes one core call and answers in Tinker's shapes; the
handlers live by group, each module the owner of its routes:
- ``tinker_sessions``: health, client configuration, sessions, the account and the server's capabilities;
- ``tinker_training``: a training run's operations, each answered with a future at once (and the custom losses);
- ``tinker_futures``: sampling and the futures' long polls (and what a sample's result does not carry);
- ``tinker_registry``: training runs and checkpoints, and their downloads.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lathe.errors import Internal, LatheError, NotFound

from .auth import ApiKeys
from .core import GatewayCore
from .downloads import FILES_ROUTE, Downloads, UrlSigner
from .limits import DecodeGate, HttpLimits
from .tinker_futures import FutureRoutes
from .tinker_io import PREFIX, Bodies, error_response, json_response
from .tinker_registry import RegistryRoutes
from .tinker_sessions import SessionRoutes
from .tinker_training import TrainingRoutes

Handler = Callable[[Request, str], Awaitable[Response | dict[str, Any]]]


class TinkerHttpApi:
    """The ``/api/v1`` routes over one core; ``app()`` is the ASGI application to serve."""

    def __init__(self, core: GatewayCore, keys: ApiKeys, url_signer: UrlSigner | None = None,
                 http_limits: HttpLimits | None = None, public_url: str = "", gate: DecodeGate | None = None
                 ) -> None:
        """``public_url``: this door's root as clients reach it (``https://lathe.example.com`` behind an Ingress that
        ends TLS), for the download URLs it signs; "": the scheme and host each request arrived with. ``gate``: the
        places for decoding large bodies, shared with the gRPC door (default: this door's own)."""
        self.core = core
        self.keys = keys
        limits = http_limits or HttpLimits()
        self.bodies = Bodies(core, limits, gate or DecodeGate(limits.max_concurrent_decodes))
        self.downloads = Downloads(core.checkpoints, url_signer,
                                   quota=lambda tenant: core.quotas.of(tenant).max_checkpoint_bytes)
        self.sessions = SessionRoutes(core, self.bodies)
        self.training = TrainingRoutes(core, self.bodies)
        self.futures = FutureRoutes(core, self.bodies, self.downloads)
        self.registry = RegistryRoutes(core, self.bodies, self.downloads, public_url.rstrip("/"))

    def app(self) -> Starlette:
        s, t, f, r = self.sessions, self.training, self.futures, self.registry
        routes: list[tuple[str, str, Handler]] = [
            ("GET", "/healthz", s.healthz),
            ("POST", "/client/config", s.client_config),
            ("POST", "/client/dynamic_config", s.dynamic_config),
            ("POST", "/create_session", s.create_session),
            ("POST", "/session_heartbeat", s.session_heartbeat),
            ("POST", "/telemetry", s.telemetry),
            ("POST", "/sessions/{session_id}/finish", s.finish_session),
            ("GET", "/sessions", s.list_sessions),
            ("GET", "/sessions/{session_id}", s.get_session),
            ("POST", "/sessions/search", s.search_sessions),
            ("POST", "/auth/token", s.auth_token),
            ("GET", "/billing/usage/checkpoints/current", s.storage_usage),
            ("POST", "/copy_weights", r.copy_weights),
            ("GET", "/get_server_capabilities", s.get_server_capabilities),
            ("POST", "/create_model", t.create_model),
            ("POST", "/get_info", t.get_info),
            ("POST", "/create_custom_loss", t.create_custom_loss),
            ("POST", "/forward_backward", t.forward_backward),
            ("POST", "/optim_step", t.optim_step),
            ("POST", "/save_weights", t.save_weights),
            ("POST", "/save_weights_for_sampler", t.save_weights_for_sampler),
            ("POST", "/load_weights", t.load_weights),
            ("POST", "/create_sampling_session", f.create_sampling_session),
            ("POST", "/join_sampling_session", f.join_sampling_session),
            ("GET", "/samplers/{sampling_session_id}", f.get_sampler),
            ("POST", "/asample", f.asample),
            ("POST", "/retrieve_future", f.retrieve_future),
            ("POST", "/retrieve_futures", f.retrieve_futures),
            ("POST", "/cancel_future", f.cancel_future),
            ("GET", "/training_runs", r.list_training_runs),
            ("GET", "/training_runs/{run_id}", r.get_training_run),
            ("GET", "/training_runs/{run_id}/checkpoints", r.list_run_checkpoints),
            ("PUT", "/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl", r.set_checkpoint_ttl),
            ("POST", "/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", r.publish_checkpoint),
            ("DELETE", "/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", r.unpublish_checkpoint),
            # after .../publish, which this pattern would also match
            ("DELETE", "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", r.delete_checkpoint),
            ("GET", "/checkpoints", r.list_user_checkpoints),
            ("POST", "/weights_info", r.weights_info),
            ("POST", "/save_weights_external", t.save_weights_external),
            ("GET", "/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls",
             r.external_weights_urls),
        ]
        return Starlette(routes=[Route(PREFIX + path, self.core.metrics.timed(fn.__name__, self._endpoint(fn)),
                                       methods=[method])
                                 for method, path, fn in routes]
                         + [Route(PREFIX + FILES_ROUTE, r.checkpoint_file, methods=["GET"])],  # signed, no key
                         exception_handlers={HTTPException: self._no_route})

    async def _no_route(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(NotFound(f"{request.method} {request.url.path}: {exc.detail}"))

    def _endpoint(self, fn: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                request.state.tenant = tenant = self.keys.tinker_tenant(request.headers.get("x-api-key"))
                result = await fn(request, tenant)
            except LatheError as e:
                return error_response(e)
            except Exception as e:  # noqa: BLE001 - a bug answers 500 (retried by the SDK), never a hang
                return error_response(Internal(f"internal error in {fn.__name__}: {type(e).__name__}: {e}"))
            return result if isinstance(result, Response) else json_response(result)

        return endpoint
