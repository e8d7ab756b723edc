"""The gRPC front door: ``lathe.v1.Gateway`` calls -> ``GatewayCore`` calls.

Authentication: the ``x-api-key`` metadata entry, mapped to a tenant by ``ApiKeys``. Core errors
become gRPC status codes (``lathe.errors``); no handler writes error text of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from lathe.errors import LatheError
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc

from .auth import ApiKeys
from .core import GatewayCore

Handler = Callable[[Any, str, Any], Awaitable[Any]]


def _api_key(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "x-api-key":
            return value
    return None


def authed(fn: Handler) -> Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    """Resolve the tenant, call ``fn(self, request, tenant)``, and map core errors to status codes."""

    @functools.wraps(fn)
    async def wrapper(self: GatewayServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, self.keys.tenant(_api_key(context)))
        except LatheError as e:
            await context.abort(e.status, e.message)

    return wrapper


class GatewayServicer(pb_grpc.GatewayServicer):
    def __init__(self, core: GatewayCore, keys: ApiKeys) -> None:
        self.core = core
        self.keys = keys

    @authed
    async def CreateSession(self, request: pb.CreateSessionRequest, tenant: str) -> pb.CreateSessionResponse:
        return pb.CreateSessionResponse(session_id=self.core.create_session(tenant, dict(request.user_metadata)))

    @authed
    async def Heartbeat(self, request: pb.HeartbeatRequest, tenant: str) -> pb.Empty:
        self.core.session(tenant, request.session_id)
        return pb.Empty()

    @authed
    async def GetServerCapabilities(self, request: pb.GetServerCapabilitiesRequest, tenant: str
                                    ) -> pb.ServerCapabilities:
        return await self.core.capabilities()

    @authed
    async def CreateModel(self, request: pb.CreateModelRequest, tenant: str) -> pb.SubmitResponse:
        return await self.core.create_model(tenant, request)

    @authed
    async def CreateModelFromState(self, request: pb.CreateModelFromStateRequest, tenant: str
                                   ) -> pb.SubmitResponse:
        return await self.core.create_model_from_state(tenant, request)

    @authed
    async def GetInfo(self, request: pb.GetInfoRequest, tenant: str) -> pb.ModelInfo:
        return await self.core.get_info(tenant, request.model_id)

    @authed
    async def ForwardBackward(self, request: pb.ForwardBackwardRequest, tenant: str) -> pb.SubmitResponse:
        return await self.core.submit(tenant, request.model_id, request.seq_id, forward_backward=request)

    @authed
    async def OptimStep(self, request: pb.OptimStepRequest, tenant: str) -> pb.SubmitResponse:
        return await self.core.submit(tenant, request.model_id, request.seq_id, optim_step=request)

    @authed
    async def Save(self, request: pb.SaveRequest, tenant: str) -> pb.SubmitResponse:
        return await self.core.submit(tenant, request.model_id, request.seq_id, save=request)

    @authed
    async def Load(self, request: pb.LoadRequest, tenant: str) -> pb.SubmitResponse:
        return await self.core.submit(tenant, request.model_id, request.seq_id, load=request)

    @authed
    async def RetrieveFuture(self, request: pb.RetrieveFutureRequest, tenant: str) -> pb.FutureResult:
        return await self.core.retrieve(tenant, request.request_id, request.timeout_s)

    @authed
    async def ListTrainingRuns(self, request: pb.ListTrainingRunsRequest, tenant: str
                               ) -> pb.ListTrainingRunsResponse:
        runs, total = self.core.list_runs(tenant, request.limit, request.offset)
        return pb.ListTrainingRunsResponse(training_runs=[r.proto() for r in runs], total_count=total)

    @authed
    async def GetTrainingRun(self, request: pb.GetTrainingRunRequest, tenant: str) -> pb.TrainingRun:
        return self.core.run(tenant, request.training_run_id).proto()

    @authed
    async def ListCheckpoints(self, request: pb.ListRunCheckpointsRequest, tenant: str
                              ) -> pb.ListRunCheckpointsResponse:
        return await self.core.list_checkpoints(tenant, request.training_run_id, request.limit, request.offset)

    @authed
    async def DeleteCheckpoint(self, request: pb.DeleteCheckpointRequest, tenant: str) -> pb.Empty:
        await self.core.delete_checkpoint(tenant, request.tinker_path)
        return pb.Empty()

    @authed
    async def CreateSamplingSession(self, request: pb.CreateSamplingSessionRequest, tenant: str
                                    ) -> pb.SamplingSession:
        return await self.core.create_sampling_session(tenant, request)

    @authed
    async def GetSamplingSession(self, request: pb.GetSamplingSessionRequest, tenant: str) -> pb.SamplingSession:
        return self.core.sampling_session(tenant, request.sampling_session_id).proto()

    @authed
    async def Sample(self, request: pb.SampleRequest, tenant: str) -> pb.SubmitResponse:
        return await self.core.sample(tenant, request)
