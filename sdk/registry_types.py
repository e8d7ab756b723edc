"""The registry answers of Lathe's ``RestClient`` about sessions, checkpoints and the caller, shaped like the
official ``tinker`` SDK's types of the same names.

Plain dataclasses owned by the user's process; ``lathe.wire`` fills them from ``lathe.v1`` messages (the
values a user builds and the training results are ``lathe.types``'). Lathe's
readings: the caller's tenant is its own user and organization (``WhoamiResponse``), so it is every session's
``owner``; Lathe has no projects (``project_id`` is always None) and prices nothing (no cost fields are filled).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from lathe.types import AdamOptimizerConfig, OptimizerConfig

FinishStatus = Literal["success", "errored", "interrupted"]
FINISH_STATUSES: tuple[FinishStatus, ...] = ("success", "errored", "interrupted")
SamplingClientKind = Literal["snapshot", "inflight"]


@dataclass(slots=True)
class GetSessionResponse:
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None


@dataclass(slots=True)
class ListSessionsResponse:
    sessions: list[str]  # session ids, newest first


@dataclass(frozen=True, slots=True)
class SearchOwner:
    """Whose sessions: ``"own"`` and ``"accessible"`` are both the caller's; ``"user"`` those of ``owner_urns``
    (tenants) that are the caller's."""

    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SessionStatusQuery:
    """``"active"``; ``"client_finished"`` with the finish ``reasons`` asked for (None: any); ``"failed"`` and
    ``"cancelled"`` match nothing in Lathe."""

    type: Literal["active", "client_finished", "failed", "cancelled"]
    reasons: tuple[FinishStatus, ...] | None = None


@dataclass(frozen=True, slots=True)
class SessionSearchCursor:
    last_created_at: datetime
    last_session_id: str


@dataclass(slots=True)
class SessionSearchRequest:
    """Tinker's search filters (a tinker ``types.SessionSearchRequest`` is taken as well): ``session_id`` or
    ``display_name`` (either matches), every ``user_metadata`` pair, one of ``statuses`` (None: any)."""

    session_id: str | None = None
    project_ids: list[str] | None = None  # refused: Lathe has no projects
    user_metadata: dict[str, str] = field(default_factory=dict)
    display_name: str | None = None
    owner: SearchOwner = field(default_factory=SearchOwner)
    statuses: list[SessionStatusQuery] | None = None
    limit: int = 50
    cursor: SessionSearchCursor | None = None


@dataclass(frozen=True, slots=True)
class SessionStatus:
    """``type`` ``"active"``, or ``"client_finished"`` with the ``reason`` its client gave."""

    type: Literal["active", "client_finished"]
    reason: FinishStatus | None = None


@dataclass(slots=True)
class SessionSummary:
    session_id: str
    created_at: datetime
    owner: str
    status: SessionStatus | None  # None: finished for a reason Tinker does not name
    checkpoints_count: int
    checkpoint_storage_bytes: int
    user_metadata: dict[str, str] = field(default_factory=dict)
    display_name: str | None = None
    project_id: str | None = None


@dataclass(slots=True)
class SessionSearchResponse:
    sessions: list[SessionSummary]
    next_cursor: SessionSearchCursor | None = None


@dataclass(slots=True)
class WhoamiResponse:
    user_urn: str
    org_urn: str
    email: str | None = None


@dataclass(slots=True)
class CurrentCheckpointStorageUsageItem:
    org_user_urn: str
    user_name: str
    checkpoint_count: int
    size_bytes: int
    size_gigabytes: float
    project_id: str | None = None
    user_email: str | None = None
    estimated_monthly_cost_usd: float | None = None


@dataclass(slots=True)
class CurrentCheckpointStorageUsageResponse:
    """One row for the caller's tenant (none while it has no checkpoints), live now."""

    data: list[CurrentCheckpointStorageUsageItem]
    effective_rate_usd_per_gigabyte_month: float | None = None


@dataclass(slots=True)
class WeightsInfoResponse:
    """A checkpoint's weights; the module flags are None once its run has left the registry (a copy's, say)."""

    base_model: str
    is_lora: bool = True
    lora_rank: int | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None
    train_unembed: bool | None = None
    optimizer_config: OptimizerConfig = field(default_factory=AdamOptimizerConfig)  # AdamW when not known


@dataclass(slots=True)
class GetSamplerResponse:
    sampler_id: str
    base_model: str
    model_path: str | None = None


@dataclass(slots=True)
class ExternalWeightsUrlsResponse:
    """One GET URL per file of an external weights checkpoint (no API key needed), valid until ``expires``."""

    urls: dict[str, str]
    expires: datetime
