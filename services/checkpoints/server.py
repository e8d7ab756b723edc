"""The gRPC door of the checkpoints room: ``lathe.v1.Checkpoints`` messages in, ``CheckpointService`` calls.

Handlers only translate: store I/O is blocking, so each call runs in a worker thread, and a core
``LatheError`` becomes the call's status code with the core's message. The streamed calls bridge
the call's async message stream and the core's blocking chunk iterators one chunk at a time, so a
checkpoint never sits whole in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

import grpc

from lathe.channels import CHANNEL_OPTIONS
from lathe.errors import InvalidArgument, LatheError, Unavailable
from lathe.runtime.internal_auth import server_interceptors
from lathe.runtime.probes import Probes
from lathe.v1 import checkpoints_pb2 as cpb
from lathe.v1 import checkpoints_pb2_grpc as cpb_grpc

from .layout import CheckpointInfo
from .metrics import CheckpointMetrics, store_kind
from .service import CheckpointService
from .store import open_store

log = logging.getLogger("lathe.checkpoints")
CHUNK_TIMEOUT_S = 300.0  # the longest wait for the next message of a PutStream
T = TypeVar("T")


async def _call(context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except LatheError as e:
        await context.abort(e.status, e.message)  # raises: the call ends with that status


def _info(info: CheckpointInfo) -> cpb.CheckpointInfo:
    return cpb.CheckpointInfo(**asdict(info))


def _blocking(messages: AsyncIterator[cpb.PutCheckpointChunk], loop: asyncio.AbstractEventLoop
              ) -> Iterator[cpb.PutCheckpointChunk]:
    """The messages of a client stream, for a worker thread (each ``next`` waits on the event loop)."""
    while True:
        try:
            yield asyncio.run_coroutine_threadsafe(anext(messages), loop).result(timeout=CHUNK_TIMEOUT_S)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise Unavailable(f"PutStream: no message for {CHUNK_TIMEOUT_S:.0f} s; nothing was saved") from None


def _file_chunks(messages: Iterator[cpb.PutCheckpointChunk]) -> Iterator[tuple[str, Iterator[bytes]]]:
    """(file name, chunks) per file of a PutStream after its header, up to its ``done``; a stream that ends
    without ``done`` (the client went away) raises, so that a truncated checkpoint never commits."""
    def chunks() -> Iterator[cpb.FileChunk]:
        for m in messages:
            part = m.WhichOneof("part")
            if part == "done":
                return
            if part != "chunk":
                raise InvalidArgument(f"PutStream: only the first message may be a header; got {part!r} later")
            yield m.chunk
        raise Unavailable("PutStream ended without its final 'done' message; nothing was saved")

    for name, group in itertools.groupby(chunks(), key=lambda c: c.file):
        yield name, (c.data for c in group)


class CheckpointsServicer(cpb_grpc.CheckpointsServicer):
    def __init__(self, service: CheckpointService, metrics: CheckpointMetrics | None = None) -> None:
        self.service = service
        self.metrics = metrics or CheckpointMetrics()

    async def Put(self, request: cpb.PutCheckpointRequest, context: grpc.aio.ServicerContext) -> cpb.CheckpointInfo:
        started = time.perf_counter()
        info = await _call(context, self.service.put, tenant=request.tenant, run_id=request.run_id,
                           kind=request.kind, name=request.name, files=dict(request.files),
                           metadata_json=request.metadata_json, ttl_seconds=request.ttl_seconds,
                           overwrite=request.overwrite, max_tenant_bytes=request.max_tenant_bytes)
        self.metrics.saved(info.size_bytes, time.perf_counter() - started)
        return _info(info)

    async def PutStream(self, request_iterator: AsyncIterator[cpb.PutCheckpointChunk],
                        context: grpc.aio.ServicerContext) -> cpb.CheckpointInfo:
        started = time.perf_counter()
        first = await anext(request_iterator, None)
        if first is None or first.WhichOneof("part") != "header" or first.header.files:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "PutStream must start with a header: a PutCheckpointRequest with no files")
        h = first.header
        files = _file_chunks(_blocking(request_iterator, asyncio.get_running_loop()))
        info = await _call(context, self.service.put_stream, tenant=h.tenant, run_id=h.run_id, kind=h.kind,
                           name=h.name, files=files, metadata_json=h.metadata_json, ttl_seconds=h.ttl_seconds,
                           overwrite=h.overwrite, max_tenant_bytes=h.max_tenant_bytes)
        self.metrics.saved(info.size_bytes, time.perf_counter() - started)
        return _info(info)

    async def GetStream(self, request: cpb.CheckpointRef, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[cpb.GetCheckpointChunk]:
        started = time.perf_counter()
        info, sizes, chunks = await _call(context, self.service.get_stream, request.tenant, request.path)
        yield cpb.GetCheckpointChunk(header=cpb.GetCheckpointHeader(info=_info(info), file_sizes=sizes))
        while (item := await _call(context, next, chunks, None)) is not None:
            name, data = item
            yield cpb.GetCheckpointChunk(chunk=cpb.FileChunk(file=name, data=data))
        self.metrics.loaded(sum(sizes.values()), time.perf_counter() - started)

    async def Get(self, request: cpb.CheckpointRef, context: grpc.aio.ServicerContext) -> cpb.GetCheckpointResponse:
        started = time.perf_counter()
        info, files = await _call(context, self.service.get, request.tenant, request.path)
        self.metrics.loaded(sum(map(len, files.values())), time.perf_counter() - started)
        return cpb.GetCheckpointResponse(info=_info(info), files=files)

    async def Stat(self, request: cpb.CheckpointRef, context: grpc.aio.ServicerContext) -> cpb.CheckpointInfo:
        return _info(await _call(context, self.service.stat, request.tenant, request.path))

    async def List(self, request: cpb.ListCheckpointsRequest, context: grpc.aio.ServicerContext
                   ) -> cpb.ListCheckpointsResponse:
        page = await _call(context, self.service.list, request.tenant, request.run_id, request.limit, request.offset)
        return cpb.ListCheckpointsResponse(checkpoints=[_info(i) for i in page.checkpoints],
                                           total_count=page.total_count)

    async def Delete(self, request: cpb.CheckpointRef, context: grpc.aio.ServicerContext
                     ) -> cpb.DeleteCheckpointResponse:
        await _call(context, self.service.delete, request.tenant, request.path)
        return cpb.DeleteCheckpointResponse()

    async def SetTtl(self, request: cpb.SetTtlRequest, context: grpc.aio.ServicerContext) -> cpb.CheckpointInfo:
        return _info(await _call(context, self.service.set_ttl, request.tenant, request.path, request.ttl_seconds))

    async def SetPublic(self, request: cpb.SetPublicRequest, context: grpc.aio.ServicerContext) -> cpb.CheckpointInfo:
        return _info(await _call(context, self.service.set_public, request.tenant, request.path, request.public))

    async def Locate(self, request: cpb.LocateRequest, context: grpc.aio.ServicerContext) -> cpb.LocateResponse:
        info, files, expires_at = await _call(context, self.service.locate, request.tenant, request.path,
                                              request.expires_in_s)
        return cpb.LocateResponse(info=_info(info), expires_at=expires_at,
                                  files={n: cpb.StoredFile(**asdict(f)) for n, f in files.items()})

    async def Export(self, request: cpb.ExportRequest, context: grpc.aio.ServicerContext) -> cpb.CheckpointInfo:
        return _info(await _call(context, self.service.export, tenant=request.tenant,
                                 source_path=request.source_path, name=request.name,
                                 ttl_seconds=request.ttl_seconds, age_recipients=list(request.age_recipients),
                                 max_tenant_bytes=request.max_tenant_bytes))


async def _sweep_every(service: CheckpointService, interval_s: float) -> None:
    """Sweep now, then every ``interval_s``; a failed sweep is logged and retried next round."""
    while True:
        try:
            swept = await asyncio.to_thread(service.sweep_expired)
        except Exception:
            log.exception("checkpoint sweep failed")
        else:
            if swept.expired or swept.orphan_files:
                log.info("swept %d expired checkpoints and %d orphan files", swept.expired, swept.orphan_files)
        await asyncio.sleep(interval_s)


def _store_answers(service: CheckpointService) -> bool:
    """Readiness: the object store answers a lookup (of a key no checkpoint uses)."""
    service.store.exists("readiness-probe")
    return True


class CheckpointsServer:
    """A started checkpoints server: the ``grpc.aio`` server, the port it bound, its core, the sweeper, and its
    ``probes`` (health: ready while the store answers; metrics: ``lathe.checkpoints.metrics``).

    (A bare ``grpc.aio.Server`` cannot say which port it picked for port 0, and the periodic TTL sweep
    must stop with it; hence this handle.)
    """

    __slots__ = ("server", "port", "service", "probes", "_sweeper")

    def __init__(self, server: grpc.aio.Server, port: int, service: CheckpointService, sweep_interval_s: float,
                 probes: Probes) -> None:
        self.server, self.probes = server, probes
        self.port = port
        self.service = service
        self._sweeper = asyncio.create_task(_sweep_every(service, sweep_interval_s))

    async def stop(self, grace: float | None = None) -> None:
        self._sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._sweeper
        await self.probes.shutdown()
        await self.server.stop(grace)


async def serve(port: int, root: Path | str, host: str = "127.0.0.1", *, sweep_interval_s: float = 60.0
                ) -> CheckpointsServer:
    """Start a checkpoints server on ``host:port`` (0 = a free port) over the store at ``root``.

    ``root`` is a directory or a store URL (see ``lathe.checkpoints.store.open_store``). Messages up
    to 1 GiB pass both ways. Only callers holding the stack's secret get through (``lathe.runtime.internal_auth``).
    """
    if sweep_interval_s <= 0:
        raise ValueError(f"sweep_interval_s must be > 0, got {sweep_interval_s}")
    service = CheckpointService(open_store(root))
    probes = Probes("lathe.v1.Checkpoints", "lathe_checkpoints", ready=lambda: _store_answers(service))
    server = grpc.aio.server(options=CHANNEL_OPTIONS,
                             interceptors=[probes.requests, *server_interceptors("lathe.checkpoints", host)])
    cpb_grpc.add_CheckpointsServicer_to_server(
        CheckpointsServicer(service, CheckpointMetrics(probes.registry, store_kind(root))), server)
    probes.install(server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await probes.start()
    await server.start()
    return CheckpointsServer(server, bound, service, sweep_interval_s, probes)
