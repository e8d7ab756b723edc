"""Conversions between ``lathe.v1`` registry messages and ``lathe.registry_types`` values, for ``RestClient``.

Requests are built from Lathe's values or from the official SDK's own (a tinker ``SessionSearchRequest`` has the
same field names), read by attribute. Times come as float seconds since the epoch and leave as UTC datetimes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from lathe.info_wire import optimizer_config_of
from lathe.registry_types import (
    CurrentCheckpointStorageUsageItem,
    CurrentCheckpointStorageUsageResponse,
    ExternalWeightsUrlsResponse,
    GetSamplerResponse,
    GetSessionResponse,
    SessionSearchCursor,
    SessionSearchResponse,
    SessionStatus,
    SessionSummary,
    WeightsInfoResponse,
    WhoamiResponse,
)
from lathe.v1 import lathe_pb2 as pb


def _time(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def _optional(msg: Any, name: str) -> Any:  # any proto3 optional scalar
    return getattr(msg, name) if msg.HasField(name) else None


def session_search_to_proto(req: Any) -> pb.SearchSessionsRequest:  # Lathe's or tinker's request
    """A ``SessionSearchRequest`` (Lathe's, or tinker's: the same fields) as the gateway's request."""
    owner = req.owner
    cursor = req.cursor
    return pb.SearchSessionsRequest(
        session_id=req.session_id, display_name=req.display_name, user_metadata=dict(req.user_metadata or {}),
        statuses=[pb.SessionStatusQuery(type=q.type, reasons=list(getattr(q, "reasons", None) or ()))
                  for q in req.statuses or ()],
        owner_type=owner.type, owner_urns=list(getattr(owner, "owner_urns", None) or ()), limit=req.limit,
        cursor_session_id=cursor.last_session_id if cursor is not None else "",
        project_ids=list(req.project_ids or ()))


def _summary(msg: pb.SessionSummary) -> SessionSummary:
    status = SessionStatus(msg.status, msg.finish_reason or None) if msg.status else None  # type: ignore[arg-type]
    return SessionSummary(session_id=msg.session_id, created_at=_time(msg.created_at), owner=msg.owner,
                          status=status, checkpoints_count=msg.checkpoints_count,
                          checkpoint_storage_bytes=msg.checkpoint_storage_bytes,
                          user_metadata=dict(msg.user_metadata), display_name=_optional(msg, "display_name"))


def session_search_from_proto(msg: pb.SearchSessionsResponse) -> SessionSearchResponse:
    sessions = [_summary(s) for s in msg.sessions]
    cursor = None
    if msg.next_cursor_session_id:
        last = next(s for s in sessions if s.session_id == msg.next_cursor_session_id)
        cursor = SessionSearchCursor(last_created_at=last.created_at, last_session_id=last.session_id)
    return SessionSearchResponse(sessions=sessions, next_cursor=cursor)


def session_from_proto(msg: pb.SessionInfo) -> GetSessionResponse:
    return GetSessionResponse(training_run_ids=list(msg.training_run_ids), sampler_ids=list(msg.sampler_ids),
                              user_metadata=dict(msg.user_metadata), display_name=_optional(msg, "display_name"))


def whoami_from_proto(msg: pb.WhoamiResponse) -> WhoamiResponse:
    return WhoamiResponse(user_urn=msg.user_urn, org_urn=msg.org_urn)


def storage_usage_from_proto(msg: pb.StorageUsage) -> CurrentCheckpointStorageUsageResponse:
    """One row for the caller, none while it has no checkpoints (as Tinker answers)."""
    rows = [CurrentCheckpointStorageUsageItem(
        org_user_urn=msg.owner, user_name=msg.owner, checkpoint_count=msg.checkpoint_count,
        size_bytes=msg.size_bytes, size_gigabytes=msg.size_bytes / 1e9)] if msg.checkpoint_count else []
    return CurrentCheckpointStorageUsageResponse(data=rows)


def weights_info_from_proto(msg: pb.WeightsInfo) -> WeightsInfoResponse:
    return WeightsInfoResponse(base_model=msg.base_model, is_lora=msg.is_lora, lora_rank=_optional(msg, "lora_rank"),
                               train_mlp=_optional(msg, "train_mlp"), train_attn=_optional(msg, "train_attn"),
                               train_unembed=_optional(msg, "train_unembed"),
                               optimizer_config=optimizer_config_of(msg.optimizer))


def sampler_from_proto(msg: pb.SamplingSession) -> GetSamplerResponse:
    return GetSamplerResponse(sampler_id=msg.sampling_session_id, base_model=msg.base_model,
                              model_path=msg.model_path or None)


def external_urls_from_proto(msg: pb.ExternalWeightsUrls) -> ExternalWeightsUrlsResponse:
    return ExternalWeightsUrlsResponse(urls=dict(msg.urls), expires=_time(msg.expires_at))
