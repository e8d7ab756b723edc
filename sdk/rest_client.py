"""``RestClient``: the caller's training runs and checkpoints in the gateway's registry, shaped like Tinker's.

Made by ``ServiceClient.create_rest_client()``; shares its connection and needs no session. As in Tinker,
every method returns an ``APIFuture`` at once: ``.result()`` it, or ``await`` it. The gateway answers only
with what the caller's API key owns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import Message

from lathe import wire
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


class RestClient:
    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def _query(self, rpc: str, request: Message, decode: Callable[[Any], T]) -> APIFuture[T]:
        async def run() -> T:
            return decode(await self._conn.call(rpc, request))

        return call_future(self._conn, run())

    def get_server_capabilities(self) -> APIFuture[GetServerCapabilitiesResponse]:
        return self._query("GetServerCapabilities", pb.GetServerCapabilitiesRequest(), wire.capabilities_from_proto)

    def list_training_runs(self, limit: int = 20, offset: int = 0) -> APIFuture[TrainingRunsResponse]:
        """The caller's training runs, oldest first, one page."""
        return self._query("ListTrainingRuns", pb.ListTrainingRunsRequest(limit=limit, offset=offset),
                           lambda msg: wire.training_runs_from_proto(msg, limit, offset))

    def get_training_run(self, training_run_id: str) -> APIFuture[TrainingRun]:
        return self._query("GetTrainingRun", pb.GetTrainingRunRequest(training_run_id=training_run_id),
                           wire.training_run_from_proto)

    def get_training_run_by_tinker_path(self, tinker_path: str) -> APIFuture[TrainingRun]:
        """The run a checkpoint path (``tinker://<run>/<kind>/<name>``) belongs to."""
        return self.get_training_run(ParsedCheckpointTinkerPath.from_tinker_path(tinker_path).training_run_id)

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
