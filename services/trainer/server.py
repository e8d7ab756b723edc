"""gRPC door of the trainer: translates ``lathe.v1.Trainer`` calls into ``TrainerEngine`` calls.

``Run`` takes a request through the intake (``lathe.trainer.intake``: decoded and checked on a worker thread,
outside the engine's lock, then queued) and answers its ``Result`` as a ``pb.TrainerResult``; an operation failed
because the pool lost a rank (``RankLost``: it never ran) is answered as the RPC status UNAVAILABLE instead."""

from __future__ import annotations

import asyncio

import grpc

from lathe.errors import LatheError
from lathe.trainer import intake
from lathe.trainer.dist import RankLost
from lathe.trainer.engine import TrainerEngine
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc


class TrainerServicer(pb_grpc.TrainerServicer):
    def __init__(self, engine: TrainerEngine) -> None:
        self.engine = engine

    async def Capabilities(self, request: pb.TrainerCapabilitiesRequest, context: grpc.aio.ServicerContext
                           ) -> pb.ServerCapabilities:
        try:
            return self.engine.capabilities()
        except LatheError as e:
            await context.abort(e.status, e.message)

    async def CreateAdapter(self, request: pb.CreateAdapterRequest, context: grpc.aio.ServicerContext
                            ) -> pb.AdapterInfo:
        try:
            return await asyncio.to_thread(self.engine.create_adapter, request)
        except LatheError as e:
            await context.abort(e.status, e.message)

    async def Run(self, request: pb.TrainerOp, context: grpc.aio.ServicerContext) -> pb.TrainerResult:
        try:
            fut = await asyncio.to_thread(intake.submit, self.engine, request)
        except LatheError as e:
            await context.abort(e.status, e.message)
        res = await asyncio.wrap_future(fut)
        if isinstance(res.error, RankLost):  # never ran: UNAVAILABLE, which the gateway retries on the re-formed pool
            await context.abort(res.error.status, res.error.message)
        return intake.result_to_proto(res)
