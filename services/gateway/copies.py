"""Copying a checkpoint to a new path of the same tenant (Tinker's ``copy_weights``).

In: the tenant, the source ``tinker://`` path (either kind), the run id the copy goes under and its TTL. Out: the
copy's ``CheckpointInfo``: the same kind, name, metadata and files at ``tinker://<run_id>/<kind>/<name>``, written
through the checkpoints service (``GetStream`` of the source into ``PutStream`` of the copy, one 4 MiB piece at a
time, so a copy holds no whole checkpoint in memory; the tenant's ``max_checkpoint_bytes`` binds as on a save).

Owns nothing: the copy's run id is the caller's choice (``copy_run_id``: derived from the request's idempotency
key, so a retried request lands on the copy its first attempt made and answers it again instead of copying
twice). Never touches another tenant's checkpoint: the checkpoints service answers it as missing.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator

import grpc

from lathe.errors import NotFound, from_rpc_error
from lathe.v1 import checkpoints_pb2 as cpb
from lathe.v1 import checkpoints_pb2_grpc as cpb_grpc

COPY_RUN_PREFIX = "copy-"
_CALL_TIMEOUT_S = 600.0


def copy_run_id(tenant: str, idempotency_key: str | None) -> str:
    """The run id a copy goes under: the same for every retry of one request (its idempotency key), else new."""
    if not idempotency_key:
        return COPY_RUN_PREFIX + uuid.uuid4().hex[:16]
    return COPY_RUN_PREFIX + hashlib.sha256(f"{tenant}\0{idempotency_key}".encode()).hexdigest()[:16]


async def copy_checkpoint(stub: cpb_grpc.CheckpointsStub, tenant: str, source: str, run_id: str, ttl_seconds: int,
                          max_tenant_bytes: int) -> cpb.CheckpointInfo:
    """Copy ``source`` to ``run_id``; a copy already there (an earlier attempt of the same request) is answered.

    The copy is looked for before the upload starts, and again when the upload fails: a concurrent attempt of the
    same request may have committed first. The upload's own status is not trusted to say so, because grpc's asyncio
    client can report a server's early refusal of a client stream (ALREADY_EXISTS before the first piece is read)
    as ``INTERNAL: Internal error from Core`` when a write was in flight (grpc/grpc#36066)."""
    try:
        reader = stub.GetStream(cpb.CheckpointRef(tenant=tenant, path=source), timeout=_CALL_TIMEOUT_S)
        info = (await reader.read()).header.info
        target = cpb.CheckpointRef(tenant=tenant, path=f"tinker://{run_id}/{info.kind}/{info.name}")
        if (done := await _stat(stub, target)) is not None:
            reader.cancel()
            return done
        put = cpb.PutCheckpointRequest(tenant=tenant, run_id=run_id, kind=info.kind, name=info.name,
                                       metadata_json=info.metadata_json, ttl_seconds=ttl_seconds,
                                       max_tenant_bytes=max_tenant_bytes)
        try:
            return await stub.PutStream(_pieces(put, reader), timeout=_CALL_TIMEOUT_S)
        except grpc.RpcError:
            reader.cancel()
            if (done := await _stat(stub, target)) is not None:
                return done
            raise
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None


async def _stat(stub: cpb_grpc.CheckpointsStub, ref: cpb.CheckpointRef) -> cpb.CheckpointInfo | None:
    """The checkpoint at ``ref``, or None when there is none."""
    try:
        return await stub.Stat(ref, timeout=_CALL_TIMEOUT_S)
    except grpc.RpcError as e:
        if isinstance(from_rpc_error(e), NotFound):
            return None
        raise


async def _pieces(header: cpb.PutCheckpointRequest, reader: grpc.aio.UnaryStreamCall
                  ) -> AsyncIterator[cpb.PutCheckpointChunk]:
    """The copy's stream: its header, the source's pieces as they come, then the mark that it is complete."""
    yield cpb.PutCheckpointChunk(header=header)
    while (msg := await reader.read()) is not grpc.aio.EOF:
        yield cpb.PutCheckpointChunk(chunk=msg.chunk)
    yield cpb.PutCheckpointChunk(done=True)
