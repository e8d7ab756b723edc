"""A synchronous, torch-free client of ``lathe.v1.Checkpoints`` (used by the trainer and the sampler).

Failed calls raise the ``lathe.errors`` class the server raised (NotFound, PermissionDenied, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import grpc
from google.protobuf.message import Message

from lathe.errors import from_rpc_error
from lathe.serving import CHANNEL_OPTIONS
from lathe.v1 import checkpoints_pb2 as cpb
from lathe.v1 import checkpoints_pb2_grpc as cpb_grpc

from .service import CheckpointInfo, CheckpointList


def _info(msg: cpb.CheckpointInfo) -> CheckpointInfo:
    return CheckpointInfo(**{f.name: getattr(msg, f.name) for f in fields(CheckpointInfo)})


class CheckpointsClient:
    """One channel to a checkpoints server at ``target`` (``host:port``); safe to share between threads."""

    def __init__(self, target: str, *, timeout_s: float = 600.0) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = cpb_grpc.CheckpointsStub(self._channel)

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: Message) -> Any:
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def put(self, *, tenant: str, run_id: str, kind: str, name: str, files: Mapping[str, bytes],
            metadata_json: str = "", ttl_seconds: int = 0, overwrite: bool = False) -> str:
        """Save a checkpoint; returns its path ``tinker://<run_id>/<kind>/<name>``."""
        req = cpb.PutCheckpointRequest(tenant=tenant, run_id=run_id, kind=kind, name=name, files=dict(files),
                                       metadata_json=metadata_json, ttl_seconds=ttl_seconds, overwrite=overwrite)
        return self._call(self._stub.Put, req).path

    def get(self, *, tenant: str, path: str) -> dict[str, bytes]:
        """The checkpoint's files (verified by the server against their sha256)."""
        res = self._call(self._stub.Get, cpb.CheckpointRef(tenant=tenant, path=path))
        return dict(res.files)

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
