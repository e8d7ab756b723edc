"""The Tinker HTTP front door: the official ``tinker`` SDK's protocol under ``/api/v1``, over ``GatewayCore``.

Every handler authenticates the ``X-API-Key`` header through ``ApiKeys`` (Tinker's ``tml-`` keys), reads
its body (JSON through ``json_fields``, the ``forward_backward`` protobuf through ``tinker_proto``), makes
one core call and answers in Tinker's shapes. Model operations answer a future ``{"request_id", ...}`` at
once; ``/retrieve_future`` long-polls the core and answers the result (protobuf for forward/backward and
sampling outputs, JSON otherwise), ``{"type": "try_again"}`` when nothing came within the wait, or
``{"error", "category"}`` when the operation failed; its ``queue_state`` says whether a full trainer queue or one
of the tenant's own quotas holds new work back (``GatewayCore.queue_state``). ``/retrieve_futures`` long-polls a
sampling client's completion queue (``completions``), which the SDK then fetches one by one. A rejected call answers
the core error's HTTP status with the same ``{"error", "category"}`` body, never an empty one (429 with ``retry-after``
when waiting helps). The key is checked before the body is read. A body longer than the core's
``limits.max_message_bytes`` is refused with 413 before it is read to its end; a ``Content-Encoding: zstd`` body
(the SDK's compressed forward_backward) is inflated a piece at a time and refused with 413 as soon as it passes
``HttpLimits.max_inflated_bytes`` or the tenant's quota of that name; a body holding more than
``max_request_tokens`` values is refused before they become Python lists; and only ``max_concurrent_decodes``
large or compressed bodies are decoded at once (``limits.DecodeGate``). An ordered operation refused while its
body is decoded still passes over its ``seq_id`` (``Runs.refusing``), so the run's next operations are not
held up behind it.

State of its own: only what an HTTP request said that its result does not carry (the layout of a sample's sparse
``target_prompt_logprobs``), kept by request id for the latest requests; a gateway restart forgets it, and the
result is then answered dense.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import zstandard
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lathe.errors import Internal, InvalidArgument, LatheError, NotFound, RequestTooLarge
from lathe.types import check_no_project
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import tinker_public_pb2 as tp

from . import tinker_json as tj
from .auth import ApiKeys
from .core import GatewayCore
from .custom_losses import CustomLosses
from .downloads import FILES_ROUTE, Downloads, UrlSigner, export_note
from .futures import KEEP_DONE
from .json_fields import INT32_MAX, Fields
from .ledger import MAX_WAIT_S
from .limits import SMALL_BODY_BYTES, DecodeGate, HttpLimits
from .session_search import SessionQuery
from .tinker_proto import (
    PROTO_CONTENT_TYPE,
    forward_backward_from_proto,
    forward_backward_output_to_proto,
    parse_forward_backward,
    sample_response_to_proto,
)

PREFIX = "/api/v1"
CLIENT_CONFIG = {"use_pyqwest_transport": False, "pjwt_auth_enabled": False, "proto_compress_fwdbwd": True,
                 "sample_use_retrieve_futures": True, "sample_join_sampling_session": True,
                 "custom_loss_server_side": True}
DYNAMIC_CONFIG = {"sample_cancel_enabled": True}
INFLATE_PIECE_BYTES = 1 << 20  # a zstd body is inflated this much at a time
POLL_MARGIN_S = 15.0  # a long-poll ends this long before the client's read timeout (its x-stainless header)

Handler = Callable[[Request, str], Awaitable[Response | dict[str, Any]]]


def _json(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body), status, headers, media_type="application/json")


def error_response(err: LatheError) -> Response:
    """A core error as Tinker's SDK reads it. Client errors say ``x-should-retry: false`` so the SDK's HTTP
    layer does not resend them; a quota error says when to come back, or, when waiting frees nothing (a 429
    without ``retry_after_s``), not to retry either."""
    headers = {}
    if err.retry_after_s is not None:
        headers["retry-after"] = str(max(1, round(err.retry_after_s)))
    if 400 <= err.http_status < 500 and (err.http_status not in (408, 429) or err.retry_after_s is None):
        headers["x-should-retry"] = "false"
    return _json({"error": err.message, "category": err.category}, err.http_status, headers)


@dataclass(frozen=True, slots=True)
class _Note:
    """What the HTTP request said that its result does not carry."""

    target_layout: tp.SparseCsr | None = None  # a sample's sparse target_prompt_logprobs: the cells to answer


def _query_int(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 10 and int(raw) <= INT32_MAX):
        raise InvalidArgument(f"query parameter {name} = {raw[:32]!r} must be an integer in [0, {INT32_MAX}]")
    return int(raw)


class TinkerHttpDoor:
    """The ``/api/v1`` routes over one core; ``app()`` is the ASGI application to serve."""

    def __init__(self, core: GatewayCore, keys: ApiKeys, url_signer: UrlSigner | None = None,
                 http_limits: HttpLimits | None = None, public_url: str = "", gate: DecodeGate | None = None
                 ) -> None:
        """``public_url``: this door's root as clients reach it (``https://lathe.example.com`` behind an Ingress that
        ends TLS), for the download URLs it signs; "": the scheme and host each request arrived with. ``gate``: the
        places for decoding large bodies, shared with the gRPC door (default: this door's own)."""
        self.core = core
        self.public_url = public_url.rstrip("/")
        self.keys = keys
        self.http_limits = http_limits or HttpLimits()
        self.gate = gate or DecodeGate(self.http_limits.max_concurrent_decodes)
        self.downloads = Downloads(core.checkpoints, url_signer,
                                   quota=lambda tenant: core.quotas.of(tenant).max_checkpoint_bytes)
        self._notes: OrderedDict[str, _Note] = OrderedDict()
        self.custom_losses = CustomLosses(core.store, lambda tenant: core.quotas.of(tenant).max_custom_losses)

    def app(self) -> Starlette:
        routes = [
            ("GET", "/healthz", self.healthz),
            ("POST", "/client/config", self.client_config),
            ("POST", "/client/dynamic_config", self.dynamic_config),
            ("POST", "/create_session", self.create_session),
            ("POST", "/session_heartbeat", self.session_heartbeat),
            ("POST", "/telemetry", self.telemetry),
            ("POST", "/sessions/{session_id}/finish", self.finish_session),
            ("GET", "/sessions", self.list_sessions),
            ("GET", "/sessions/{session_id}", self.get_session),
            ("POST", "/sessions/search", self.search_sessions),
            ("POST", "/auth/token", self.auth_token),
            ("GET", "/billing/usage/checkpoints/current", self.storage_usage),
            ("POST", "/copy_weights", self.copy_weights),
            ("GET", "/get_server_capabilities", self.get_server_capabilities),
            ("POST", "/create_model", self.create_model),
            ("POST", "/get_info", self.get_info),
            ("POST", "/create_custom_loss", self.create_custom_loss),
            ("POST", "/forward_backward", self.forward_backward),
            ("POST", "/optim_step", self.optim_step),
            ("POST", "/save_weights", self.save_weights),
            ("POST", "/save_weights_for_sampler", self.save_weights_for_sampler),
            ("POST", "/load_weights", self.load_weights),
            ("POST", "/create_sampling_session", self.create_sampling_session),
            ("POST", "/join_sampling_session", self.join_sampling_session),
            ("GET", "/samplers/{sampling_session_id}", self.get_sampler),
            ("POST", "/asample", self.asample),
            ("POST", "/retrieve_future", self.retrieve_future),
            ("POST", "/retrieve_futures", self.retrieve_futures),
            ("POST", "/cancel_future", self.cancel_future),
            ("GET", "/training_runs", self.list_training_runs),
            ("GET", "/training_runs/{run_id}", self.get_training_run),
            ("GET", "/training_runs/{run_id}/checkpoints", self.list_run_checkpoints),
            ("PUT", "/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl", self.set_checkpoint_ttl),
            ("POST", "/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", self.publish_checkpoint),
            ("DELETE", "/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", self.unpublish_checkpoint),
            # after .../publish, which this pattern would also match
            ("DELETE", "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", self.delete_checkpoint),
            ("GET", "/checkpoints", self.list_user_checkpoints),
            ("POST", "/weights_info", self.weights_info),
            ("POST", "/save_weights_external", self.save_weights_external),
            ("GET", "/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls",
             self.external_weights_urls),
        ]
        return Starlette(routes=[Route(PREFIX + path, self.core.metrics.timed(fn.__name__, self._endpoint(fn)),
                                       methods=[method])
                                 for method, path, fn in routes]
                         + [Route(PREFIX + FILES_ROUTE, self.checkpoint_file, methods=["GET"])],  # signed, no key
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
            return result if isinstance(result, Response) else _json(result)

        return endpoint

    @contextlib.asynccontextmanager
    async def _body(self, request: Request) -> AsyncIterator[bytes]:
        """The request body while it is decoded: read no further than ``max_message_bytes``, a zstd one inflated
        no further than ``max_inflated_bytes`` (the gateway's, or its tenant's quota if smaller), a large or
        compressed one holding a place in the decode gate."""
        cap = self.core.limits.max_message_bytes
        declared = request.headers.get("content-length", "")
        known = declared.isascii() and declared.isdigit()
        if known and int(declared) > cap:
            raise RequestTooLarge(f"the request body has {declared} bytes, over the limit of {cap} bytes")
        encoding = request.headers.get("content-encoding", "identity")
        if encoding not in ("identity", "zstd"):
            raise InvalidArgument(f"Content-Encoding {encoding!r} is not accepted; send 'zstd' or 'identity'")
        async with self.gate.place(encoding == "zstd" or not known or int(declared) > SMALL_BODY_BYTES):
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > cap:
                    raise RequestTooLarge(f"the request body is over the limit of {cap} bytes")
                chunks.append(chunk)
            body = b"".join(chunks)
            yield body if encoding == "identity" else self._inflate(body, request.state.tenant)

    def _inflate(self, body: bytes, tenant: str) -> bytes:
        """A zstd body decompressed piece by piece, refused as soon as it passes the gateway's
        ``max_inflated_bytes`` or the tenant's quota of that name, whichever is smaller."""
        mine, cap = self.core.quotas.of(tenant).max_inflated_bytes, self.http_limits.max_inflated_bytes
        limit, pieces, size = min(cap, mine), [], 0
        which = "the tenant's max_inflated_bytes quota" if mine < cap else "max_inflated_bytes"
        try:
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
                while piece := reader.read(INFLATE_PIECE_BYTES):
                    size += len(piece)
                    if size > limit:
                        raise RequestTooLarge(f"the zstd request body ({len(body)} bytes) decompresses to over the "
                                              f"limit of {limit} bytes ({which})")
                    pieces.append(piece)
        except zstandard.ZstdError as e:
            raise InvalidArgument(f"the zstd request body does not decompress: {e}") from None
        return b"".join(pieces)

    async def fields(self, request: Request) -> Fields:
        """The JSON body of ``request``, read under the door's limits (``_body``)."""
        async with self._body(request) as body:
            return Fields.parse(body, self.http_limits.max_request_tokens)

    def _refusing(self, tenant: str, f: Fields) -> contextlib.AbstractContextManager[None]:
        """``Runs.refusing`` for the ordered operation whose body is ``f`` (its ids must read)."""
        return self.core.runs.refusing(tenant, f.get("model_id", str), f.get("seq_id", int))

    def _note(self, request_id: str, note: _Note) -> None:
        self._notes[request_id] = note
        while len(self._notes) > KEEP_DONE:
            self._notes.popitem(last=False)

    @staticmethod
    def _future(sub: pb.SubmitResponse) -> dict[str, Any]:
        return {"request_id": sub.request_id, "model_id": sub.model_id or None}

    # ---- client and session ----

    async def healthz(self, request: Request, tenant: str) -> dict[str, Any]:
        """Tinker's readiness probe: the door is up and the caller's key is accepted."""
        return {"status": "ok"}

    async def client_config(self, request: Request, tenant: str) -> dict[str, Any]:
        return CLIENT_CONFIG

    async def dynamic_config(self, request: Request, tenant: str) -> dict[str, Any]:
        return DYNAMIC_CONFIG

    async def create_session(self, request: Request, tenant: str) -> dict[str, Any]:
        f = await self.fields(request)
        check_no_project("project_id", f.get("project_id", str, None))
        session_id = self.core.book.create(tenant, f.strings("user_metadata"), f.get("display_name", str, None))
        return {"type": "create_session", "session_id": session_id}

    async def session_heartbeat(self, request: Request, tenant: str) -> dict[str, Any]:
        self.core.book.heartbeat(tenant, (await self.fields(request)).get("session_id", str))
        return {"type": "session_heartbeat"}

    async def telemetry(self, request: Request, tenant: str) -> dict[str, Any]:
        return {"status": "accepted"}  # accepted and dropped: Lathe exports its own metrics

    async def finish_session(self, request: Request, tenant: str) -> dict[str, Any]:
        reason = (await self.fields(request)).sub("reason", required=False).get("type", str, "")
        self.core.book.finish(tenant, request.path_params["session_id"], reason)
        return {}

    async def list_sessions(self, request: Request, tenant: str) -> dict[str, Any]:
        """The caller's sessions, newest first (``access_scope`` aside: a tenant sees only its own)."""
        limit, offset = _query_int(request, "limit", 20), _query_int(request, "offset", 0)
        return {"sessions": self.core.registry.list_sessions(tenant, limit, offset)}

    async def get_session(self, request: Request, tenant: str) -> dict[str, Any]:
        s, run_ids, sampler_ids = self.core.registry.session_members(tenant, request.path_params["session_id"])
        return {"training_run_ids": run_ids, "sampler_ids": sampler_ids, "user_metadata": s.user_metadata,
                "display_name": s.display_name}

    async def search_sessions(self, request: Request, tenant: str) -> dict[str, Any]:
        """A page of the caller's sessions matching the filters (``session_search``), each with the count and bytes
        of its runs' live checkpoints."""
        query = SessionQuery.from_fields(await self.fields(request))
        found, last = await self.core.registry.search_sessions(tenant, query)
        return {"sessions": [tj.session_summary(s, checkpoints) for s, checkpoints in found],
                "next_cursor": None if last is None else {"last_created_at": tj.iso(last.created_at),
                                                          "last_session_id": last.session_id}}

    async def auth_token(self, request: Request, tenant: str) -> dict[str, Any]:
        """A token naming the caller (``tinker_json.identity_token``): Lathe keeps to API keys, and answers so that
        an SDK told to exchange its key goes on."""
        return {"jwt": tj.identity_token(tenant, time.time())}

    async def storage_usage(self, request: Request, tenant: str) -> dict[str, Any]:
        """The caller's live checkpoints, counted and summed (``project_id`` is refused: Lathe has no projects)."""
        count, size = await self.core.registry.storage_usage(tenant, request.query_params.get("project_id", "")[:64])
        return tj.storage_usage(tenant, count, size)

    async def get_server_capabilities(self, request: Request, tenant: str) -> dict[str, Any]:
        return tj.capabilities(await self.core.lookups.capabilities())

    # ---- training ----

    async def create_model(self, request: Request, tenant: str) -> dict[str, Any]:
        f = await self.fields(request)
        return self._future(await self.core.runs.create_model(tenant, pb.CreateModelRequest(
            session_id=f.get("session_id", str), base_model=f.get("base_model", str),
            lora_config=tj.lora_config(f.sub("lora_config", required=False)),
            user_metadata=f.strings("user_metadata"), optimizer=tj.optimizer_family(f, "optimizer_config")),
            model_seq_id=f.get("model_seq_id", int)))

    async def get_info(self, request: Request, tenant: str) -> dict[str, Any]:
        return tj.model_info(await self.core.runs.get_info(tenant, (await self.fields(request)).get("model_id", str)))

    async def forward_backward(self, request: Request, tenant: str) -> dict[str, Any]:
        content_type = request.headers.get("content-type", "")
        if not content_type.startswith(PROTO_CONTENT_TYPE):
            raise InvalidArgument(f"forward_backward takes a {PROTO_CONTENT_TYPE} body (tinker_public."
                                  f"ForwardBackwardRequest), not {content_type or 'no Content-Type'!r}")
        async with self._body(request) as body:
            msg = parse_forward_backward(body)
            with self.core.runs.refusing(tenant, msg.model_id, msg.seq_id):
                req = forward_backward_from_proto(msg, self.core.limits.max_tensor_elements,
                                                  self.http_limits.max_request_tokens)
                if req.loss_fn == "custom":
                    self.custom_losses.resolve(tenant, req)
                if req.loss_fn == "stable_reinforce":  # its behaviour logprobs are the record's
                    self.core.stability.resolve(tenant, msg, req)
        return self._future(await self.core.runs.submit(tenant, req.model_id, req.seq_id, forward_backward=req))

    async def create_custom_loss(self, request: Request, tenant: str) -> dict[str, Any]:
        """Check and keep a traced loss (``custom_losses``); the future answers its ``loss_id`` at once."""
        f = await self.fields(request)
        session_id = f.get("session_id", str)
        self.core.book.get(tenant, session_id)
        inputs = [Fields(x, f"{f.path('inputs')}[{i}]") for i, x in enumerate(f.get("inputs", list))]
        loss = pb.CustomLoss(name=f.get("name", str), graph_json=json.dumps(f.get("graph", dict)), inputs=[
            pb.CustomLossInput(name=x.get("name", str), rank=x.get("rank", int, int_max=INT32_MAX)) for x in inputs])
        loss_id = self.custom_losses.create(tenant, session_id, f.get("custom_loss_seq_id", int), loss)
        result = pb.FutureResult(custom_loss=pb.CustomLossOutput(loss_id=loss_id))
        return {"request_id": self.core.ledger.answered(tenant, result), "model_id": None}

    async def optim_step(self, request: Request, tenant: str) -> dict[str, Any]:
        f = await self.fields(request)
        with self._refusing(tenant, f):
            req = tj.optim_step(f)
        return self._future(await self.core.runs.submit(tenant, req.model_id, req.seq_id, optim_step=req))

    async def save_weights(self, request: Request, tenant: str) -> dict[str, Any]:
        f = await self.fields(request)
        with self._refusing(tenant, f):
            req = pb.SaveRequest(model_id=f.get("model_id", str), seq_id=f.get("seq_id", int),
                                 name=f.get("path", str), kind="weights", ttl_seconds=f.get("ttl_seconds", int, 0),
                                 overwrite=f.get("overwrite", bool, False), user_metadata=f.strings("user_metadata"))
        return self._future(await self.core.runs.submit(tenant, req.model_id, req.seq_id, save=req))

    async def save_weights_for_sampler(self, request: Request, tenant: str) -> dict[str, Any]:
        """Named: a sampler checkpoint. Unnamed (``save_weights_and_get_sampling_client``): an ephemeral
        one, answered with the sampling session bound to it."""
        f = await self.fields(request)
        model_id, seq_id = f.get("model_id", str), f.get("seq_id", int)
        with self._refusing(tenant, f):
            name = f.get("path", str, "")
            inflight = tj.sampling_kind(f) == "inflight"
            if name and inflight:
                raise InvalidArgument(f"{f.path('kind')} = 'inflight' publishes unnamed weights: drop path "
                                      f"{name!r}, or save a named snapshot")
            if name:
                req = pb.SaveRequest(model_id=model_id, seq_id=seq_id, name=name, kind="sampler_weights",
                                     ttl_seconds=f.get("ttl_seconds", int, 0),
                                     user_metadata=f.strings("user_metadata"))
            else:
                sampling_seq_id = f.get("sampling_session_seq_id", int)
        if name:
            return self._future(await self.core.runs.submit(tenant, model_id, seq_id, save=req))
        return self._future(self.core.runs.save_for_sampling(tenant, model_id, seq_id, sampling_seq_id, inflight))

    async def load_weights(self, request: Request, tenant: str) -> dict[str, Any]:
        """With ``session_id``: a new training run loaded from ``path`` (create_training_client_from_state*).
        Otherwise the legacy form: a load into ``model_id`` at ``seq_id`` (load_state*)."""
        f = await self.fields(request)
        if f.get("session_id", str, None) is None:
            with self._refusing(tenant, f):
                path, with_optimizer = self._load_source(f)
                req = pb.LoadRequest(model_id=f.get("model_id", str), seq_id=f.get("seq_id", int), path=path,
                                     with_optimizer=with_optimizer)
            return self._future(await self.core.runs.submit(tenant, req.model_id, req.seq_id, load=req))
        path, with_optimizer = self._load_source(f)
        return self._future(await self.core.runs.create_model_from_state(
            tenant, pb.CreateModelFromStateRequest(session_id=f.get("session_id", str), path=path,
                                                   with_optimizer=with_optimizer,
                                                   user_metadata=f.strings("user_metadata"),
                                                   optimizer=tj.optimizer_family(f, "optimizer_config")),
            model_seq_id=f.get("model_seq_id", int), base_model=f.get("base_model", str, "")))

    @staticmethod
    def _load_source(f: Fields) -> tuple[str, bool]:
        """A ``/load_weights`` body's ``path`` and ``optimizer`` (a checkpoint of another account is refused)."""
        if f.get("weights_access_token", str, None) is not None:
            raise InvalidArgument("weights_access_token is not supported: load checkpoints of your own account")
        return f.get("path", str), f.get("optimizer", bool)

    # ---- sampling ----

    async def create_sampling_session(self, request: Request, tenant: str) -> dict[str, Any]:
        f = await self.fields(request)
        session = await self.core.sampling.create_session(tenant, pb.CreateSamplingSessionRequest(
            session_id=f.get("session_id", str), model_path=f.get("model_path", str, ""),
            base_model=f.get("base_model", str, "")), seq_id=f.get("sampling_session_seq_id", int))
        return {"type": "create_sampling_session", "sampling_session_id": session.sampling_session_id}

    async def join_sampling_session(self, request: Request, tenant: str) -> dict[str, Any]:
        sid = (await self.fields(request)).get("sampling_session_id", str)
        return {"type": "join_sampling_session", "client_counter": self.core.sampling.join(tenant, sid)}

    async def get_sampler(self, request: Request, tenant: str) -> dict[str, Any]:
        s = self.core.sampling.get(tenant, request.path_params["sampling_session_id"])
        return {"sampler_id": s.sampling_session_id, "base_model": s.base_model, "model_path": s.model_path or None}

    async def asample(self, request: Request, tenant: str) -> dict[str, Any]:
        req, layout = tj.sample_request(await self.fields(request), self.core.limits.max_tensor_elements)
        sub = await self.core.sampling.sample(tenant, req)
        if layout is not None:
            self._note(sub.request_id, _Note(target_layout=layout))
        return {"request_id": sub.request_id,
                "sample_sequence_ids": [f"{sub.request_id}:{i}" for i in range(req.num_samples)]}

    # ---- futures ----

    @staticmethod
    def _poll_s(request: Request) -> float:
        """How long a long-poll may hold: until shortly before the client's read timeout."""
        try:
            return max(1.0, float(request.headers.get("x-stainless-read-timeout", "")) - POLL_MARGIN_S)
        except ValueError:
            return MAX_WAIT_S

    async def retrieve_future(self, request: Request, tenant: str) -> Response | dict[str, Any]:
        request_id = (await self.fields(request)).get("request_id", str)
        res = await self.core.ledger.retrieve(tenant, request_id, self._poll_s(request))
        if not res.done:
            return {"type": "try_again", "request_id": request_id, "queue_state": res.queue_state,
                    "queue_state_reason": res.queue_state_reason or None}
        if res.WhichOneof("result") == "save" and Downloads.maybe_staging(res.save.path):
            exported = await self.downloads.finish_export(tenant, res.save.path)  # a save_weights_external
            if exported is not None:
                return exported
        return self._result(res, self._notes.get(request_id, _Note()))

    async def retrieve_futures(self, request: Request, tenant: str) -> dict[str, Any]:
        """The samples of one sampling client finished since ``prev_cursor``; ``timeout`` 0 answers at once.
        ``retrieved_request_ids`` is accepted and not needed: results stay as long as the core keeps them."""
        f = await self.fields(request)
        target = f.sub("target")
        kind = target.get("type", str, "sampling_session")
        if kind != "sampling_session":
            raise InvalidArgument(f"{target.path('type')} = {kind!r}: only 'sampling_session' targets are served")
        timeout = f.get("timeout", float, None)
        events, cursor = await self.core.sampling.completed(
            tenant, target.get("sampling_session_id", str), target.get("cloned_sampler_id", int, 0),
            f.get("prev_cursor", int, 0), self._poll_s(request) if timeout is None else max(0.0, timeout))
        return {"completions": [{"state": "failed" if e.failed else "finished", "request_id": e.request_id}
                                for e in events], "cursor": cursor}

    async def cancel_future(self, request: Request, tenant: str) -> dict[str, Any]:
        """Cancel a sample not finished yet (``Ledger.cancel``); one already finished keeps its result."""
        request_id = (await self.fields(request)).get("request_id", str)
        return {"request_id": request_id, "cancelled": self.core.ledger.cancel(tenant, request_id)}

    @staticmethod
    def _result(res: pb.FutureResult, note: _Note) -> Response | dict[str, Any]:
        kind = res.WhichOneof("result")
        if kind == "error":
            return {"error": res.error.message, "category": res.error.category or "unknown"}
        if kind == "forward_backward":
            return Response(forward_backward_output_to_proto(res.forward_backward), media_type=PROTO_CONTENT_TYPE)
        if kind == "sample":
            return Response(sample_response_to_proto(res.sample, note.target_layout), media_type=PROTO_CONTENT_TYPE)
        if kind == "create_model":
            return {"model_id": res.create_model.model_id}
        if kind == "custom_loss":
            return {"type": "create_custom_loss", "loss_id": res.custom_loss.loss_id}
        if kind == "optim_step":
            return {"metrics": dict(res.optim_step.metrics)}
        if kind == "save":
            return {"path": res.save.path, "sampling_session_id": res.save.sampling_session_id or None}
        return {"path": res.load.path, "model_id": res.load.model_id}

    # ---- registry ----

    async def list_training_runs(self, request: Request, tenant: str) -> dict[str, Any]:
        limit, offset = _query_int(request, "limit", 20), _query_int(request, "offset", 0)
        runs, total = self.core.registry.list_runs(tenant, limit, offset, request.query_params.get("project_id"))
        return {"training_runs": [tj.training_run(r) for r in runs], "cursor": tj.cursor(offset, limit, total)}

    async def get_training_run(self, request: Request, tenant: str) -> dict[str, Any]:
        return tj.training_run(self.core.runs.get(tenant, request.path_params["run_id"]))

    async def list_run_checkpoints(self, request: Request, tenant: str) -> dict[str, Any]:
        res = await self.core.registry.list_checkpoints(tenant, request.path_params["run_id"], 0, 0)
        return {"checkpoints": [tj.checkpoint(c) for c in res.checkpoints]}

    async def list_user_checkpoints(self, request: Request, tenant: str) -> dict[str, Any]:
        limit, offset = _query_int(request, "limit", 100), _query_int(request, "offset", 0)
        res = await self.core.registry.list_checkpoints(tenant, "", limit, offset)
        return {"checkpoints": [tj.checkpoint(c) for c in res.checkpoints],
                "cursor": tj.cursor(offset, limit, res.total_count)}

    async def copy_weights(self, request: Request, tenant: str) -> dict[str, Any]:
        """A copy of one of the caller's checkpoints at a new path (``Registry.copy_checkpoint``), answered at
        once. ``destination_project_id`` names nothing here (the copy stays the caller's); the
        ``X-Idempotency-Key`` the SDK keeps across its retries makes a retry answer the first copy."""
        f = await self.fields(request)
        if f.get("weights_access_token", str, None) or request.headers.get("x-tinker-weights-access-token"):
            raise InvalidArgument("weights_access_token is not supported: copy checkpoints of your own account")
        path = await self.core.registry.copy_checkpoint(
            tenant, f.get("source_path", str), f.get("ttl_seconds", int, None),
            request.headers.get("x-idempotency-key"), f.get("session_id", str, None), f.get("model_seq_id", int, None))
        return {"tinker_path": path}

    async def delete_checkpoint(self, request: Request, tenant: str) -> dict[str, Any]:
        p = request.path_params
        await self.core.registry.delete_checkpoint(tenant, f"tinker://{p['run_id']}/{p['checkpoint_id']}")
        return {}

    @staticmethod
    def _checkpoint_path(request: Request) -> str:
        p = request.path_params
        return f"tinker://{p['run_id']}/{p['kind']}/{p['name']}"

    async def set_checkpoint_ttl(self, request: Request, tenant: str) -> dict[str, Any]:
        """``{"ttl_seconds": n}``: expire n seconds from now; ``null``: never."""
        ttl = (await self.fields(request)).get("ttl_seconds", int, None)
        await self.core.registry.set_checkpoint_ttl(tenant, self._checkpoint_path(request), ttl)
        return {}

    async def publish_checkpoint(self, request: Request, tenant: str) -> dict[str, Any]:
        await self.core.registry.set_checkpoint_public(tenant, self._checkpoint_path(request), True)
        return {}

    async def unpublish_checkpoint(self, request: Request, tenant: str) -> dict[str, Any]:
        await self.core.registry.set_checkpoint_public(tenant, self._checkpoint_path(request), False)
        return {}

    # ---- downloads (``downloads.py``) ----

    async def save_weights_external(self, request: Request, tenant: str) -> dict[str, Any]:
        """A sampler snapshot of the run, turned into ``tinker://<run>/external_weights/<name>`` when its future
        is retrieved."""
        f = await self.fields(request)
        model_id, seq_id = f.get("model_id", str), f.get("seq_id", int)
        with self._refusing(tenant, f):
            note = export_note(f.get("age_encryption_recipients", list, None), f.get("path", str),
                               f.get("ttl_seconds", int, None))
        sub = await self.core.runs.submit(tenant, model_id, seq_id, save=Downloads.staging_save(model_id, seq_id, note))
        return self._future(sub)

    async def external_weights_urls(self, request: Request, tenant: str) -> dict[str, Any]:
        root = self.public_url or str(request.base_url).rstrip("/")
        return await self.downloads.urls(tenant, self._checkpoint_path(request), root + PREFIX)

    async def checkpoint_file(self, request: Request) -> Response:
        """The file a signed download URL names (no API key: the signature is the authority)."""
        try:
            return await self.downloads.file(request.path_params["token"])
        except LatheError as e:
            return error_response(e)

    async def weights_info(self, request: Request, tenant: str) -> dict[str, Any]:
        """``Registry.weights_info`` (without the checkpoint's run in the registry, Tinker's default: AdamW)."""
        path = (await self.fields(request)).get("tinker_path", str)
        return tj.weights_info(await self.core.registry.weights_info(tenant, path))
