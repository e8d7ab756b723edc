"""``RestClient``: the caller's training runs and checkpoints in the gateway's registry, shaped like Tinker's.

Made by ``ServiceClient.create_rest_client()`` (sharing its connection) or on its own with
``RestClient(base_url=..., api_key=...)`` (owning a connection of its own, closed by ``close()``); needs no
session. As in Tinker, every method returns an ``APIFuture`` at once (``.result()`` it, or ``await`` it), and
its ``_async`` twin is a coroutine that returns the value. The gateway answers only with what the caller's API
key owns, so ``access_scope="accessible"`` (owned plus shared with the caller) answers the same as ``"owned"``:
Lathe shares no runs across tenants. Lathe has no projects: a project id given is refused (``InvalidArgument``).
Sessions, storage usage, weights info and download URLs come back as ``lathe.registry_types`` values.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Literal, TypeVar

from google.protobuf.message import Message

from lathe import info_wire, registry_wire
from lathe.connect import open_connection
from lathe.errors import InvalidArgument
from lathe.futures import APIFuture, Connection, call_future
from lathe.registry_types import (
    CurrentCheckpointStorageUsageResponse,
    ExternalWeightsUrlsResponse,
    GetSamplerResponse,
    GetSessionResponse,
    ListSessionsResponse,
    SessionSearchRequest,
    SessionSearchResponse,
    WeightsInfoResponse,
    WhoamiResponse,
)
from lathe.types import (
    CheckpointsListResponse,
    GetServerCapabilitiesResponse,
    ParsedCheckpointTinkerPath,
    TrainingRun,
    TrainingRunsResponse,
    check_no_project,
    check_weights_access_token,
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
        return self._query("GetServerCapabilities", pb.GetServerCapabilitiesRequest(),
                           info_wire.capabilities_from_proto)

    def list_training_runs(self, limit: int = 20, offset: int = 0, access_scope: AccessScope = "owned",
                           project_id: str | None = None) -> APIFuture[TrainingRunsResponse]:
        """The caller's training runs, oldest first, one page."""
        _check_scope(access_scope)
        check_no_project("project_id", project_id)
        return self._query("ListTrainingRuns", pb.ListTrainingRunsRequest(limit=limit, offset=offset),
                           lambda msg: info_wire.training_runs_from_proto(msg, limit, offset))

    def get_training_run(self, training_run_id: str, access_scope: AccessScope = "owned") -> APIFuture[TrainingRun]:
        _check_scope(access_scope)
        return self._query("GetTrainingRun", pb.GetTrainingRunRequest(training_run_id=training_run_id),
                           info_wire.training_run_from_proto)

    def get_training_run_by_tinker_path(self, tinker_path: str, access_scope: AccessScope = "owned"
                                        ) -> APIFuture[TrainingRun]:
        """The run a checkpoint path (``tinker://<run>/<kind>/<name>``) belongs to."""
        run_id = ParsedCheckpointTinkerPath.from_tinker_path(tinker_path).training_run_id
        return self.get_training_run(run_id, access_scope)

    def list_checkpoints(self, training_run_id: str) -> APIFuture[CheckpointsListResponse]:
        """Every live checkpoint (training and sampler) of one run; unpaged, so no cursor."""
        return self._query("ListCheckpoints", pb.ListRunCheckpointsRequest(training_run_id=training_run_id),
                           info_wire.checkpoints_from_proto)

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0) -> APIFuture[CheckpointsListResponse]:
        """The caller's checkpoints across all runs, one page, with a cursor."""
        return self._query("ListCheckpoints", pb.ListRunCheckpointsRequest(limit=limit, offset=offset),
                           lambda msg: info_wire.checkpoints_from_proto(msg, limit, offset))

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> APIFuture[None]:
        """Delete checkpoint ``checkpoint_id`` (``"<kind>/<name>"``) of a run."""
        return self.delete_checkpoint_from_tinker_path(f"tinker://{training_run_id}/{checkpoint_id}")

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        return self._query("DeleteCheckpoint", pb.DeleteCheckpointRequest(tinker_path=tinker_path), lambda _: None)

    def copy_weights(self, path: str, destination_project_id: str | None = None, *, ttl_seconds: int | None = None,
                     weights_access_token: str | None = None) -> APIFuture[str]:
        """Copy one of the caller's checkpoints (either kind) to a run of its own, ``copy-<id>`` (it samples and
        loads like any checkpoint, but cannot be trained on); the copy's path. It expires after ``ttl_seconds``
        (None: never) and counts against the caller's checkpoint quota. A retried call makes no second copy."""
        check_no_project("destination_project_id", destination_project_id)
        check_weights_access_token(weights_access_token)
        request = pb.CopyWeightsRequest(source_path=path, ttl_seconds=ttl_seconds, idempotency_key=uuid.uuid4().hex)
        return self._query("CopyWeights", request, lambda msg: msg.tinker_path)

    def set_checkpoint_ttl_from_tinker_path(self, tinker_path: str, ttl_seconds: int | None
                                            ) -> APIFuture[None]:
        """Make the checkpoint expire ``ttl_seconds`` from now (None: never)."""
        return self._query("SetCheckpointTtl", pb.SetCheckpointTtlRequest(tinker_path=tinker_path,
                                                                          ttl_seconds=ttl_seconds), lambda _: None)

    def publish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        """Mark the checkpoint ``public`` in listings (Lathe lets no other tenant read it; doing it twice is fine)."""
        return self._query("SetCheckpointPublic", pb.SetCheckpointPublicRequest(tinker_path=tinker_path, public=True),
                           lambda _: None)

    def unpublish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        return self._query("SetCheckpointPublic", pb.SetCheckpointPublicRequest(tinker_path=tinker_path,
                                                                                public=False), lambda _: None)

    def get_weights_info_by_tinker_path(self, tinker_path: str) -> APIFuture[WeightsInfoResponse]:
        return self._query("GetWeightsInfo", pb.WeightsInfoRequest(tinker_path=tinker_path),
                           registry_wire.weights_info_from_proto)

    def get_current_checkpoint_storage_usage(self, project_id: str | None = None
                                             ) -> APIFuture[CurrentCheckpointStorageUsageResponse]:
        """The caller's live checkpoints now, counted and summed (no lag; unpriced)."""
        return self._query("GetCheckpointStorageUsage", pb.StorageUsageRequest(project_id=project_id or ""),
                           registry_wire.storage_usage_from_proto)

    def get_external_weights_urls(self, tinker_path: str) -> APIFuture[ExternalWeightsUrlsResponse]:
        """Download URLs (no key needed) of each file of an external weights checkpoint
        (``TrainingClient.save_weights_external``), valid for an hour."""
        return self._query("GetExternalWeightsUrls", pb.ExternalWeightsUrlsRequest(tinker_path=tinker_path),
                           registry_wire.external_urls_from_proto)

    def get_sampler(self, sampler_id: str) -> APIFuture[GetSamplerResponse]:
        """A sampling client's binding: its base model and the checkpoint it samples (None: the base model)."""
        return self._query("GetSamplingSession", pb.GetSamplingSessionRequest(sampling_session_id=sampler_id),
                           registry_wire.sampler_from_proto)

    # ---- sessions ----

    def list_sessions(self, limit: int = 20, offset: int = 0, access_scope: AccessScope = "owned"
                      ) -> APIFuture[ListSessionsResponse]:
        """The caller's session ids, newest first, one page."""
        _check_scope(access_scope)
        return self._query("ListSessions", pb.ListSessionsRequest(limit=limit, offset=offset),
                           lambda msg: ListSessionsResponse(sessions=list(msg.session_ids)))

    def get_session(self, session_id: str, access_scope: AccessScope = "owned") -> APIFuture[GetSessionResponse]:
        """A session's training runs and sampling clients, its metadata and display name."""
        _check_scope(access_scope)
        return self._query("GetSession", pb.GetSessionRequest(session_id=session_id), registry_wire.session_from_proto)

    def search_sessions(self, request: SessionSearchRequest) -> APIFuture[SessionSearchResponse]:
        """A page of the caller's sessions matching ``request`` (Lathe's ``SessionSearchRequest`` or tinker's),
        newest first, each with its runs' live checkpoints counted; pass ``next_cursor`` on for the next page."""
        return self._query("SearchSessions", registry_wire.session_search_to_proto(request),
                           registry_wire.session_search_from_proto)

    def whoami(self) -> APIFuture[WhoamiResponse]:
        """The caller's tenant, as its user and its organization."""
        return self._query("Whoami", pb.WhoamiRequest(), registry_wire.whoami_from_proto)

    list_training_runs_async = _async_twin(list_training_runs)
    get_training_run_async = _async_twin(get_training_run)
    get_training_run_by_tinker_path_async = _async_twin(get_training_run_by_tinker_path)
    list_checkpoints_async = _async_twin(list_checkpoints)
    list_user_checkpoints_async = _async_twin(list_user_checkpoints)
    delete_checkpoint_async = _async_twin(delete_checkpoint)
    delete_checkpoint_from_tinker_path_async = _async_twin(delete_checkpoint_from_tinker_path)
    copy_weights_async = _async_twin(copy_weights)
    set_checkpoint_ttl_from_tinker_path_async = _async_twin(set_checkpoint_ttl_from_tinker_path)
    publish_checkpoint_from_tinker_path_async = _async_twin(publish_checkpoint_from_tinker_path)
    unpublish_checkpoint_from_tinker_path_async = _async_twin(unpublish_checkpoint_from_tinker_path)
    get_current_checkpoint_storage_usage_async = _async_twin(get_current_checkpoint_storage_usage)
    get_external_weights_urls_async = _async_twin(get_external_weights_urls)
    get_sampler_async = _async_twin(get_sampler)
    list_sessions_async = _async_twin(list_sessions)
    get_session_async = _async_twin(get_session)
