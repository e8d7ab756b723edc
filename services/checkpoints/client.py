"""A synchronous, torch-free client of ``lathe.v1.Checkpoints`` (used by the trainer, the sampler and the
``lathe`` CLI).

Checkpoint bytes travel as streams of ``CHUNK_BYTES`` pieces (``PutStream`` / ``GetStream``), so no
message and no buffer in between holds a whole checkpoint; ``download`` writes files to disk as the
chunks arrive. Failed calls raise the ``lathe.errors`` class the server raised (NotFound, ...).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message

from lathe.errors import from_rpc_error
from lathe.internal_auth import internal_channel
from lathe.serving import CHANNEL_OPTIONS
from lathe.v1 import checkpoints_pb2 as cpb
from lathe.v1 import checkpoints_pb2_grpc as cpb_grpc

from .service import CheckpointInfo, CheckpointList
from .store import CHUNK_BYTES


def _info(msg: cpb.CheckpointInfo) -> CheckpointInfo:
    return CheckpointInfo(**{f.name: getattr(msg, f.name) for f in fields(CheckpointInfo)})


class CheckpointsClient:
    """One channel to a checkpoints server at ``target`` (``host:port``); safe to share between threads.
    Every call carries this process's internal token (``lathe.internal_auth``)."""

    def __init__(self, target: str, *, timeout_s: float = 600.0) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._channel = internal_channel(target, CHANNEL_OPTIONS)
        self._stub = cpb_grpc.CheckpointsStub(self._channel)

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: Message) -> Any:
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def put(self, *, tenant: str, run_id: str, kind: str, name: str, files: Mapping[str, bytes],
            metadata_json: str = "", ttl_seconds: int = 0, overwrite: bool = False) -> str:
        """Save a checkpoint (streamed); returns its path ``tinker://<run_id>/<kind>/<name>``."""
        header = cpb.PutCheckpointRequest(tenant=tenant, run_id=run_id, kind=kind, name=name,
                                          metadata_json=metadata_json, ttl_seconds=ttl_seconds, overwrite=overwrite)

        def messages() -> Iterator[cpb.PutCheckpointChunk]:
            yield cpb.PutCheckpointChunk(header=header)
            for file_name, data in sorted(files.items()):
                view = memoryview(data)
                for start in range(0, max(len(view), 1), CHUNK_BYTES):
                    yield cpb.PutCheckpointChunk(chunk=cpb.FileChunk(file=file_name,
                                                                     data=bytes(view[start:start + CHUNK_BYTES])))
            yield cpb.PutCheckpointChunk(done=True)

        return self._call(self._stub.PutStream, messages()).path

    def get(self, *, tenant: str, path: str) -> dict[str, bytes]:
        """The checkpoint's files (verified by the server against their sha256)."""
        _, sizes, chunks = self._open(tenant, path)
        buffers = {n: bytearray(size) for n, size in sizes.items()}
        filled = dict.fromkeys(sizes, 0)
        for name, chunk in chunks:
            buffers[name][filled[name]:filled[name] + len(chunk)] = chunk
            filled[name] += len(chunk)
        return {n: bytes(b) for n, b in buffers.items()}

    def download(self, *, tenant: str, path: str, directory: Path,
                 on_bytes: Callable[[int, int], None] | None = None) -> CheckpointInfo:
        """Write the checkpoint's files into ``directory`` as they arrive; ``on_bytes(n, total)`` after each
        chunk. Files appear under their names only once the whole stream has been verified."""
        info, sizes, chunks = self._open(tenant, path)
        directory.mkdir(parents=True, exist_ok=True)
        partial = {n: directory / f".{n}.partial" for n in sizes}
        try:
            files = {n: p.open("wb") for n, p in partial.items()}
            try:
                for name, chunk in chunks:
                    files[name].write(chunk)
                    if on_bytes is not None:
                        on_bytes(len(chunk), info.size_bytes)
            finally:
                for f in files.values():
                    f.close()
            for name, p in partial.items():
                os.replace(p, directory / name)
        finally:
            for p in partial.values():
                p.unlink(missing_ok=True)
        return info

    def _open(self, tenant: str, path: str) -> tuple[CheckpointInfo, dict[str, int], Iterator[tuple[str, bytes]]]:
        """Start a GetStream: its header (info, file sizes) now, then (file name, chunk) pairs."""
        stream = self._stub.GetStream(cpb.CheckpointRef(tenant=tenant, path=path), timeout=self.timeout_s)
        try:
            header = next(stream).header
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

        def chunks() -> Iterator[tuple[str, bytes]]:
            try:
                for msg in stream:
                    yield msg.chunk.file, msg.chunk.data
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None

        return _info(header.info), dict(header.file_sizes), chunks()

    def stat(self, *, tenant: str, path: str) -> CheckpointInfo:
        return _info(self._call(self._stub.Stat, cpb.CheckpointRef(tenant=tenant, path=path)))

    def list(self, *, tenant: str, run_id: str = "", limit: int = 0, offset: int = 0) -> CheckpointList:
        """The tenant's live checkpoints (of one run, or all), oldest first; ``limit`` 0 = no limit."""
        req = cpb.ListCheckpointsRequest(tenant=tenant, run_id=run_id, limit=limit, offset=offset)
        res = self._call(self._stub.List, req)
        return CheckpointList([_info(c) for c in res.checkpoints], res.total_count)

    def delete(self, *, tenant: str, path: str) -> None:
        self._call(self._stub.Delete, cpb.CheckpointRef(tenant=tenant, path=path))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> CheckpointsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
