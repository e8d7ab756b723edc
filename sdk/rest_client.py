"""``RestClient``: the caller's training runs and checkpoints in the gateway's registry, shaped like Tinker's.

Made by ``ServiceClient.create_rest_client()`` (sharing its connection) or on its own with
``RestClient(base_url=..., api_key=...)`` (owning a connection of its own, closed by ``close()``); needs no
session. As in Tinker, every method returns an ``APIFuture`` at once (``.result()`` it, or ``await`` it), and
its ``_async`` twin is a coroutine that returns the value. The gateway answers only with what the caller's API
key owns, so ``access_scope="accessible"`` (owned plus shared with the caller) answers the same as ``"owned"``:
Lathe shares no runs across tenants.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Literal, TypeVar

from google.protobuf.message import Message

from lathe import wire
from lathe.connect import open_connection
from lathe.errors import InvalidArgument
from lathe.futures import APIFuture, Connection, call_future
from lathe.types import (
    CheckpointsListResponse,
    GetServerCapabilitiesResponse,
    ParsedCheckpointTinkerPath,
    TrainingRun,
    TrainingRunsResponse,
)
from lathe.v1 import lathe_pb2 as pb

T = TypeVar("T")
AccessScope = Literal["owned", "accessible"]


def _async_twin(method: Callable[..., APIFuture[T]]) -> Callable[..., Coroutine[Any, Any, T]]:
    """Tinker's ``<name>_async``: the same call, awaited (same parameters, so the same signature)."""

    @functools.wraps(method)
    async def twin(self: RestClient, *args: Any, **kwargs: Any) -> T:
        return await method(self, *args, **kwargs)

    twin.__name__ = twin.__qualname__ = f"{method.__name__}_async"
    return twin


def _check_scope(access_scope: str) -> None:
    if access_scope not in ("owned", "accessible"):
        raise InvalidArgument(f"access_scope = {access_scope!r} must be 'owned' or 'accessible'")


class RestClient:
    """``RestClient(base_url=..., api_key=...)`` (with ``tls`` / ``root_certificates`` as ``ServiceClient``), or
    ``ServiceClient.create_rest_client()``."""

    def __init__(self, _conn: Connection | None = None, *, base_url: str | None = None,
                 api_key: str | None = None, tls: bool | None = None,
                 root_certificates: bytes | str | Path | None = None) -> None:
        self._owns_conn = _conn is None
        self._conn = _conn if _conn is not None else open_connection(base_url, api_key, tls=tls,
                                                                     root_certificates=root_certificates)

    def __repr__(self) -> str:
        return f"<RestClient {self._conn.target}>"

    def close(self) -> None:
        """Close the connection if this client opened it (one shared with a ServiceClient is left open)."""
        if self._owns_conn:
            self._conn.close()

    def _query(self, rpc: str, request: Message, decode: Callable[[Any], T]) -> APIFuture[T]:
        async def run() -> T:
            return decode(await self._conn.call(rpc, request))

        return call_future(self._conn, run())

    def get_server_capabilities(self) -> APIFuture[GetServerCapabilitiesResponse]:
        return self._query("GetServerCapabilities", pb.GetServerCapabilitiesRequest(), wire.capabilities_from_proto)

    def list_training_runs(self, limit: int = 20, offset: int = 0, access_scope: AccessScope = "owned"
                           ) -> APIFuture[TrainingRunsResponse]:
        """The caller's training runs, oldest first, one page."""
        _check_scope(access_scope)
        return self._query("ListTrainingRuns", pb.ListTrainingRunsRequest(limit=limit, offset=offset),
                           lambda msg: wire.training_runs_from_proto(msg, limit, offset))

    def get_training_run(self, training_run_id: str, access_scope: AccessScope = "owned") -> APIFuture[TrainingRun]:
        _check_scope(access_scope)
        return self._query("GetTrainingRun", pb.GetTrainingRunRequest(training_run_id=training_run_id),
                           wire.training_run_from_proto)

    def get_training_run_by_tinker_path(self, tinker_path: str, access_scope: AccessScope = "owned"
                                        ) -> APIFuture[TrainingRun]:
        """The run a checkpoint path (``tinker://<run>/<kind>/<name>``) belongs to."""
        run_id = ParsedCheckpointTinkerPath.from_tinker_path(tinker_path).training_run_id
        return self.get_training_run(run_id, access_scope)

    def list_checkpoints(self, training_run_id: str) -> APIFuture[CheckpointsListResponse]:
        """Every live checkpoint (training and sampler) of one run; unpaged, so no cursor."""
        return self._query("ListCheckpoints", pb.ListRunCheckpointsRequest(training_run_id=training_run_id),
                           wire.checkpoints_from_proto)

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0) -> APIFuture[CheckpointsListResponse]:
        """The caller's checkpoints across all runs, one page, with a cursor."""
        return self._query("ListCheckpoints", pb.ListRunCheckpointsRequest(limit=limit, offset=offset),
                           lambda msg: wire.checkpoints_from_proto(msg, limit, offset))

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> APIFuture[None]:
        """Delete checkpoint ``checkpoint_id`` (``"<kind>/<name>"``) of a run."""
        return self.delete_checkpoint_from_tinker_path(f"tinker://{training_run_id}/{checkpoint_id}")

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        return self._query("DeleteCheckpoint", pb.DeleteCheckpointRequest(tinker_path=tinker_path), lambda _: None)

    list_training_runs_async = _async_twin(list_training_runs)
    get_training_run_async = _async_twin(get_training_run)
    get_training_run_by_tinker_path_async = _async_twin(get_training_run_by_tinker_path)
    list_checkpoints_async = _async_twin(list_checkpoints)
    list_user_checkpoints_async = _async_twin(list_user_checkpoints)
    delete_checkpoint_async = _async_twin(delete_checkpoint)
    delete_checkpoint_from_tinker_path_async = _async_twin(delete_checkpoint_from_tinker_path)
