"""The gRPC front door: ``lathe.v1.Gateway`` calls -> ``GatewayCore`` calls.

Authentication: the ``x-api-key`` metadata entry, mapped to a tenant by ``ApiKeys``, checked twice: by
``RequireApiKey`` before the request is received (a stranger's message is never read, let alone parsed), then by each
handler, which needs the tenant. Requests that carry datums or prompts are read only while they hold a place of the
gateway's decode gate (``GateDecodes``). Core errors become gRPC status codes (``lathe.errors``); no handler
writes error text of its own.

Each registry call is the HTTP door's, through the same core call (sessions, search, storage usage, weights info,
copies, TTL, publishing). External weights go through the HTTP door's ``downloads.Downloads`` (the same staging
snapshot and export, the same signed or presigned URLs, whose files that door serves at ``files_url``): without an
HTTP door this door refuses them.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any

import grpc

from lathe.errors import FailedPrecondition, InvalidArgument, LatheError, Unauthenticated
from lathe.runtime.internal_auth import OPEN_PREFIX
from lathe.types import ParsedCheckpointTinkerPath
from lathe.v1 import checkpoints_pb2 as cpb
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc

from .auth import ApiKeys
from .console import PREFIX as CONSOLE
from .console import checkpoint_link
from .core import GatewayCore
from .downloads import Downloads, export_note
from .limits import DecodeGate
from .records import Session
from .session_search import FINISH_REASONS, SessionQuery, session_status

Handler = Callable[[Any, str, Any], Awaitable[Any]]


def _api_key(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "x-api-key":
            return value if isinstance(value, str) else None
    return None


class RequireApiKey(grpc.aio.ServerInterceptor):
    """Refuses a call whose ``x-api-key`` names no tenant before its request is received.

    grpc receives a unary request in full (up to the server's one ``max_receive_message_length``, the door's
    ``max_message_bytes``) before any handler runs, so refusing in the handler would still take in a stranger's
    64 MiB. The refusal here is a handler that takes its request as a stream and ends the call before reading a
    message: the bytes stay in the transport's flow-control window and the stream is reset. The health service
    (``lathe.runtime.internal_auth.OPEN_PREFIX``) takes no key."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIX):
            return handler
        try:
            self.keys.tenant(_api_key(details.invocation_metadata))
        except Unauthenticated as e:
            return grpc.stream_unary_rpc_method_handler(functools.partial(_refuse, e))
        return handler


async def _refuse(error: LatheError, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
    await context.abort(error.status, error.message)


GATED_METHODS = frozenset({"/lathe.v1.Gateway/ForwardBackward", "/lathe.v1.Gateway/Sample"})
"""The methods whose requests carry datums or prompts: up to ``max_message_bytes`` each."""


class GateDecodes(grpc.aio.ServerInterceptor):
    """Reads a request of ``GATED_METHODS`` only while it holds a place of ``gate`` (the HTTP door's
    ``limits.DecodeGate``, so both doors together decode at most ``max_concurrent_decodes`` such requests at once);
    one that waits ``gate.wait_s`` for a place is refused with RESOURCE_EXHAUSTED. As in ``RequireApiKey``, the
    method's handler takes its request as a stream: until it reads the one message, the bytes wait in the
    transport's flow-control window, not in the gateway. Placed after ``RequireApiKey``: a stranger takes no place."""

    def __init__(self, gate: DecodeGate) -> None:
        self.gate = gate

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method not in GATED_METHODS or handler.unary_unary is None:
            return handler

        async def gated(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            try:
                async with self.gate.place(needed=True):
                    request = await anext(aiter(requests))
            except LatheError as e:
                await context.abort(e.status, e.message)
            return await handler.unary_unary(request, context)

        return grpc.stream_unary_rpc_method_handler(gated, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)


def authed(fn: Handler) -> Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    """Resolve the tenant, call ``fn(self, request, tenant)``, and map core errors to status codes."""

    @functools.wraps(fn)
    async def wrapper(self: GatewayServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, self.keys.tenant(_api_key(context.invocation_metadata())))
        except LatheError as e:
            await context.abort(e.status, e.message)

    return wrapper


def _optional(msg: Any, name: str) -> Any:  # any proto3 optional scalar
    return getattr(msg, name) if msg.HasField(name) else None


def _session_summary(s: Session, checkpoints: list[cpb.CheckpointInfo]) -> pb.SessionSummary:
    status, reason = session_status(s)
    return pb.SessionSummary(session_id=s.session_id, created_at=s.created_at, owner=s.tenant, status=status,
                             finish_reason=reason, checkpoints_count=len(checkpoints),
                             checkpoint_storage_bytes=sum(c.size_bytes for c in checkpoints),
                             user_metadata=s.user_metadata, display_name=s.display_name)


class GatewayServicer(pb_grpc.GatewayServicer):
    """``downloads``: the HTTP door's (None: no HTTP door, so no external weights); ``files_url``: that door's
    ``/api/v1`` root as clients reach it, for the download URLs it signs; ``root_url``: the door's root, for the
    console pages a save's result links to ("": no HTTP door, no links)."""

    def __init__(self, core: GatewayCore, keys: ApiKeys, downloads: Downloads | None = None,
                 files_url: str = "", root_url: str = "") -> None:
        self.core = core
        self.keys = keys
        self.downloads = downloads
        self.files_url = files_url
        self.root_url = root_url

    def _downloads(self) -> Downloads:
        if self.downloads is None:
            raise FailedPrecondition("external weights are served with the gateway's HTTP door, and this gateway "
                                     "runs without one (--http-port)")
        return self.downloads

    @authed
    async def CreateSession(self, request: pb.CreateSessionRequest, tenant: str) -> pb.CreateSessionResponse:
        return pb.CreateSessionResponse(session_id=self.core.book.create(
            tenant, dict(request.user_metadata), _optional(request, "display_name")),
            console_url=self.root_url + CONSOLE if self.root_url else "")

    @authed
    async def FinishSession(self, request: pb.FinishSessionRequest, tenant: str) -> pb.Empty:
        if request.status not in FINISH_REASONS:
            raise InvalidArgument(f"status = {request.status!r} must be one of {list(FINISH_REASONS)}")
        self.core.book.finish(tenant, request.session_id, request.status)
        return pb.Empty()

    @authed
    async def ListSessions(self, request: pb.ListSessionsRequest, tenant: str) -> pb.ListSessionsResponse:
        page = self.core.registry.list_sessions(tenant, request.limit or 20, request.offset)
        return pb.ListSessionsResponse(session_ids=page)

    @authed
    async def GetSession(self, request: pb.GetSessionRequest, tenant: str) -> pb.SessionInfo:
        s, run_ids, sampler_ids = self.core.registry.session_members(tenant, request.session_id)
        return pb.SessionInfo(training_run_ids=run_ids, sampler_ids=sampler_ids, user_metadata=s.user_metadata,
                              display_name=s.display_name)

    @authed
    async def SearchSessions(self, request: pb.SearchSessionsRequest, tenant: str) -> pb.SearchSessionsResponse:
        query = SessionQuery.build(
            session_id=_optional(request, "session_id"), display_name=_optional(request, "display_name"),
            user_metadata=dict(request.user_metadata), owner_type=request.owner_type or "own",
            statuses=[(q.type, list(q.reasons) or None) for q in request.statuses] or None,
            owner_urns=list(request.owner_urns), limit=request.limit or 50,
            after=request.cursor_session_id or None, project_ids=list(request.project_ids))
        found, last = await self.core.registry.search_sessions(tenant, query)
        return pb.SearchSessionsResponse(sessions=[_session_summary(s, cps) for s, cps in found],
                                         next_cursor_session_id=last.session_id if last is not None else "")

    @authed
    async def Whoami(self, request: pb.WhoamiRequest, tenant: str) -> pb.WhoamiResponse:
        return pb.WhoamiResponse(user_urn=tenant, org_urn=tenant)

    @authed
    async def Heartbeat(self, request: pb.HeartbeatRequest, tenant: str) -> pb.Empty:
        self.core.book.heartbeat(tenant, request.session_id)
        return pb.Empty()

    @authed
    async def GetServerCapabilities(self, request: pb.GetServerCapabilitiesRequest, tenant: str
                                    ) -> pb.ServerCapabilities:
        return await self.core.lookups.capabilities()

    @authed
    async def CreateModel(self, request: pb.CreateModelRequest, tenant: str) -> pb.SubmitResponse:
        return await self.core.runs.create_model(tenant, request)

    @authed
    async def CreateModelFromState(self, request: pb.CreateModelFromStateRequest, tenant: str
                                   ) -> pb.SubmitResponse:
        return await self.core.runs.create_model_from_state(tenant, request)

    @authed
    async def GetInfo(self, request: pb.GetInfoRequest, tenant: str) -> pb.ModelInfo:
        return await self.core.runs.get_info(tenant, request.model_id)

    @authed
    async def ForwardBackward(self, request: pb.ForwardBackwardRequest, tenant: str) -> pb.SubmitResponse:
        return await self.core.runs.submit(tenant, request.model_id, request.seq_id, forward_backward=request)

    @authed
    async def OptimStep(self, request: pb.OptimStepRequest, tenant: str) -> pb.SubmitResponse:
        return await self.core.runs.submit(tenant, request.model_id, request.seq_id, optim_step=request)

    @authed
    async def Save(self, request: pb.SaveRequest, tenant: str) -> pb.SubmitResponse:
        with self.core.runs.refusing(tenant, request.model_id, request.seq_id):
            if request.inflight and request.kind != "sampler_weights":
                raise InvalidArgument(f"inflight = true publishes sampler weights: kind is {request.kind!r}, "
                                      "not 'sampler_weights'")
        return await self.core.runs.submit(tenant, request.model_id, request.seq_id, save=request)

    @authed
    async def Load(self, request: pb.LoadRequest, tenant: str) -> pb.SubmitResponse:
        return await self.core.runs.submit(tenant, request.model_id, request.seq_id, load=request)

    @authed
    async def SaveWeightsExternal(self, request: pb.SaveWeightsExternalRequest, tenant: str) -> pb.SubmitResponse:
        """A sampler snapshot of the run, turned into ``tinker://<run>/external_weights/<name>`` when its future
        is retrieved (``RetrieveFuture``), as on the HTTP door; refused here, it passes over its ``seq_id``."""
        with self.core.runs.refusing(tenant, request.model_id, request.seq_id):
            self._downloads()
            note = export_note(list(request.age_encryption_recipients) or None, request.name,
                               _optional(request, "ttl_seconds"))
        return await self.core.runs.submit(tenant, request.model_id, request.seq_id,
                                           save=Downloads.staging_save(request.model_id, request.seq_id, note))

    @authed
    async def GetExternalWeightsUrls(self, request: pb.ExternalWeightsUrlsRequest, tenant: str
                                     ) -> pb.ExternalWeightsUrls:
        try:
            ParsedCheckpointTinkerPath.from_tinker_path(request.tinker_path)
        except ValueError as e:
            raise InvalidArgument(f"tinker_path: {e}") from None
        got = await self._downloads().urls(tenant, request.tinker_path, self.files_url)
        return pb.ExternalWeightsUrls(urls=got["urls"], expires_at=datetime.fromisoformat(got["expires"]).timestamp())

    @authed
    async def RetrieveFuture(self, request: pb.RetrieveFutureRequest, tenant: str) -> pb.FutureResult:
        """The core's result; that of a ``SaveWeightsExternal`` answers the export, built now if not yet; a save's
        links to its console page."""
        res = await self.core.ledger.retrieve(tenant, request.request_id, request.timeout_s)
        if res.WhichOneof("result") != "save":
            return res
        out = pb.FutureResult()
        out.CopyFrom(res)  # the core keeps its own
        if self.downloads is not None and Downloads.maybe_staging(res.save.path):
            exported = await self.downloads.finish_export(tenant, res.save.path)
            if exported is not None:
                out.save.path = exported["path"]
        if self.root_url:
            out.save.console_url = f"{self.root_url}{CONSOLE}/{checkpoint_link(out.save.path)}"
        return out

    @authed
    async def ListTrainingRuns(self, request: pb.ListTrainingRunsRequest, tenant: str
                               ) -> pb.ListTrainingRunsResponse:
        runs, total = self.core.registry.list_runs(tenant, request.limit, request.offset, request.project_id)
        return pb.ListTrainingRunsResponse(training_runs=[r.proto() for r in runs], total_count=total)

    @authed
    async def GetTrainingRun(self, request: pb.GetTrainingRunRequest, tenant: str) -> pb.TrainingRun:
        return self.core.runs.get(tenant, request.training_run_id).proto()

    @authed
    async def ListCheckpoints(self, request: pb.ListRunCheckpointsRequest, tenant: str
                              ) -> pb.ListRunCheckpointsResponse:
        return await self.core.registry.list_checkpoints(tenant, request.training_run_id, request.limit, request.offset)

    @authed
    async def DeleteCheckpoint(self, request: pb.DeleteCheckpointRequest, tenant: str) -> pb.Empty:
        await self.core.registry.delete_checkpoint(tenant, request.tinker_path)
        return pb.Empty()

    @authed
    async def GetCheckpointStorageUsage(self, request: pb.StorageUsageRequest, tenant: str) -> pb.StorageUsage:
        count, size = await self.core.registry.storage_usage(tenant, request.project_id)
        return pb.StorageUsage(owner=tenant, checkpoint_count=count, size_bytes=size)

    @authed
    async def CopyWeights(self, request: pb.CopyWeightsRequest, tenant: str) -> pb.CopyWeightsResponse:
        return pb.CopyWeightsResponse(tinker_path=await self.core.registry.copy_checkpoint(
            tenant, request.source_path, _optional(request, "ttl_seconds"), request.idempotency_key or None))

    @authed
    async def SetCheckpointTtl(self, request: pb.SetCheckpointTtlRequest, tenant: str) -> pb.Empty:
        await self.core.registry.set_checkpoint_ttl(tenant, request.tinker_path, _optional(request, "ttl_seconds"))
        return pb.Empty()

    @authed
    async def SetCheckpointPublic(self, request: pb.SetCheckpointPublicRequest, tenant: str) -> pb.Empty:
        await self.core.registry.set_checkpoint_public(tenant, request.tinker_path, request.public)
        return pb.Empty()

    @authed
    async def GetWeightsInfo(self, request: pb.WeightsInfoRequest, tenant: str) -> pb.WeightsInfo:
        return await self.core.registry.weights_info(tenant, request.tinker_path)

    @authed
    async def CreateSamplingSession(self, request: pb.CreateSamplingSessionRequest, tenant: str
                                    ) -> pb.SamplingSession:
        return await self.core.sampling.create_session(tenant, request)

    @authed
    async def GetSamplingSession(self, request: pb.GetSamplingSessionRequest, tenant: str) -> pb.SamplingSession:
        return self.core.sampling.get(tenant, request.sampling_session_id).proto()

    @authed
    async def JoinSamplingSession(self, request: pb.JoinSamplingSessionRequest, tenant: str
                                  ) -> pb.JoinSamplingSessionResponse:
        """A new client of one of the tenant's sampling sessions (a sampler handle): another tenant's is NotFound."""
        number = self.core.sampling.join(tenant, request.sampling_session_id)
        return pb.JoinSamplingSessionResponse(
            session=self.core.sampling.get(tenant, request.sampling_session_id).proto(), client_counter=number)

    @authed
    async def Sample(self, request: pb.SampleRequest, tenant: str) -> pb.SubmitResponse:
        return await self.core.sampling.sample(tenant, request)
