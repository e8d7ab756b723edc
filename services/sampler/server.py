"""gRPC door of the sampler: translates ``lathe.v1.Sampler`` calls into calls of its engine (``engines.Engine``).

``Tokenizer`` hands a served model's tokenizer files to a door that takes text. ``Sample`` answers with the engine's
``SampleResult``: a per-request problem (bad argument, unknown model, overwritten checkpoint) is
``SampleResult.error`` with an OK status. Only a request the engine cannot accept at all aborts the call with its
status: RESOURCE_EXHAUSTED when the queue is full (the trailing metadata ``retry-after`` holds the seconds to wait)
and UNAVAILABLE while shutting down. If the caller goes away, the request is cancelled and its sequences leave the
batch.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from lathe.errors import LatheError, NotFound
from lathe.models.catalog import ModelCatalog
from lathe.sampler.engines import Engine
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc


def tokenizer_files(catalog: ModelCatalog, name: str) -> pb.TokenizerFiles:
    """The tokenizer files of ``catalog``'s model ``name`` (read from its directory; the model need not be loaded)."""
    try:
        directory = Path(catalog.resolve(name).path)
    except KeyError:
        raise NotFound(f"base_model {name!r} is not served by this sampler") from None
    tok, config = directory / "tokenizer.json", directory / "tokenizer_config.json"
    if not tok.is_file():
        raise NotFound(f"base_model {name!r} has no tokenizer.json, so it cannot take or give text")
    return pb.TokenizerFiles(tokenizer_json=tok.read_text(encoding="utf-8"),
                             tokenizer_config_json=config.read_text(encoding="utf-8") if config.is_file() else "{}")


class SamplerServicer(pb_grpc.SamplerServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Capabilities(self, request: pb.TrainerCapabilitiesRequest, context: grpc.aio.ServicerContext
                           ) -> pb.ServerCapabilities:
        return self.engine.capabilities()

    async def Sample(self, request: pb.SampleRequest, context: grpc.aio.ServicerContext) -> pb.SampleResult:
        try:
            fut = self.engine.sample(request)
        except LatheError as e:
            if e.retry_after_s is not None:
                context.set_trailing_metadata((("retry-after", f"{e.retry_after_s:g}"),))
            await context.abort(e.status, e.message)
        return await asyncio.wrap_future(fut)

    async def Tokenizer(self, request: pb.TokenizerRequest, context: grpc.aio.ServicerContext) -> pb.TokenizerFiles:
        try:
            return await asyncio.to_thread(tokenizer_files, self.engine.catalog, request.base_model)
        except LatheError as e:
            await context.abort(e.status, e.message)
