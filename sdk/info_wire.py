"""Conversions of the gateway's views of models and runs between ``lathe.types`` values and ``lathe.v1`` messages.

Owns both directions of: a model's info (``GetInfo``), the server's capabilities, training runs and checkpoint
listings. ``service_client`` and ``rest_client`` read replies with the ``*_from_proto`` functions; a server (or a
test's fake gateway) answers with the ``*_to_proto`` ones. Times travel as float seconds since the epoch and come
back as UTC datetimes (0 = unset). The training data, results and errors are ``lathe.wire``'s.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from datetime import UTC, datetime

from lathe.types import (
    AdamOptimizerConfig,
    Checkpoint,
    CheckpointsListResponse,
    Cursor,
    DimuonOptimizerConfig,
    Exactness,
    GetInfoResponse,
    GetServerCapabilitiesResponse,
    ModelData,
    OptimizerConfig,
    RequestLimits,
    SupportedModel,
    TrainingRun,
    TrainingRunsResponse,
)
from lathe.v1 import lathe_pb2 as pb
from lathe.wire import lora_config_from_proto, lora_config_to_proto


def _time_to_proto(t: datetime | None) -> float:
    return t.timestamp() if t is not None else 0.0


def _time_from_proto(seconds: float) -> datetime | None:
    return datetime.fromtimestamp(seconds, UTC) if seconds else None


def get_info_to_proto(info: GetInfoResponse) -> pb.ModelInfo:
    return pb.ModelInfo(model_id=info.model_id, base_model=info.model_data.model_name or "",
                        lora_config=lora_config_to_proto(info.lora_config),
                        tokenizer_id=info.model_data.tokenizer_id or "", max_context_length=info.max_context_length,
                        optimizer=info.optimizer_config.type)


def get_info_from_proto(msg: pb.ModelInfo) -> GetInfoResponse:
    return GetInfoResponse(model_id=msg.model_id,
                           model_data=ModelData(model_name=msg.base_model, tokenizer_id=msg.tokenizer_id or None),
                           lora_config=lora_config_from_proto(msg.lora_config),
                           max_context_length=msg.max_context_length,
                           optimizer_config=optimizer_config_of(msg.optimizer))


def optimizer_config_of(family: str) -> OptimizerConfig:
    """The config of an optimizer family as the gateway names it ("" : unknown, Tinker's default AdamW)."""
    return DimuonOptimizerConfig() if family == "dimuon" else AdamOptimizerConfig()


def capabilities_to_proto(caps: GetServerCapabilitiesResponse) -> pb.ServerCapabilities:
    msg = pb.ServerCapabilities(supported_models=[
        pb.SupportedModel(model_name=m.model_name, max_context_length=m.max_context_length,
                          trainer_exactness=pb.Exactness(**asdict(m.trainer_exactness)),
                          sampler_exactness=pb.Exactness(**asdict(m.sampler_exactness)),
                          logprobs_exact=m.logprobs_exact)
        for m in caps.supported_models])
    if caps.limits is not None:
        msg.limits.CopyFrom(pb.RequestLimits(**asdict(caps.limits)))
    return msg


def capabilities_from_proto(msg: pb.ServerCapabilities) -> GetServerCapabilitiesResponse:
    limits = None
    if msg.HasField("limits"):
        limits = RequestLimits(**{f.name: getattr(msg.limits, f.name) for f in fields(RequestLimits)})
    return GetServerCapabilitiesResponse(supported_models=[
        SupportedModel(m.model_name, m.max_context_length, _exactness(m.trainer_exactness),
                       _exactness(m.sampler_exactness), m.logprobs_exact)
        for m in msg.supported_models], limits=limits)


def _exactness(msg: pb.Exactness) -> Exactness:
    return Exactness(**{f.name: getattr(msg, f.name) for f in fields(Exactness)})


def checkpoint_to_proto(c: Checkpoint) -> pb.CheckpointEntry:
    return pb.CheckpointEntry(checkpoint_id=c.checkpoint_id, checkpoint_type=c.checkpoint_type,
                              tinker_path=c.tinker_path, time=_time_to_proto(c.time), size_bytes=c.size_bytes or 0,
                              expires_at=_time_to_proto(c.expires_at), user_metadata=c.user_metadata)


def checkpoint_from_proto(msg: pb.CheckpointEntry) -> Checkpoint:
    return Checkpoint(checkpoint_id=msg.checkpoint_id, checkpoint_type=msg.checkpoint_type,
                      tinker_path=msg.tinker_path, time=_time_from_proto(msg.time), size_bytes=msg.size_bytes,
                      expires_at=_time_from_proto(msg.expires_at), user_metadata=dict(msg.user_metadata))


def training_run_to_proto(run: TrainingRun) -> pb.TrainingRun:
    return pb.TrainingRun(
        training_run_id=run.training_run_id, base_model=run.base_model,
        lora_config=lora_config_to_proto(run.lora_config), created_at=_time_to_proto(run.created_at),
        last_request_time=_time_to_proto(run.last_request_time), user_metadata=run.user_metadata,
        last_checkpoint=run.last_checkpoint.tinker_path if run.last_checkpoint else "",
        last_sampler_checkpoint=run.last_sampler_checkpoint.tinker_path if run.last_sampler_checkpoint else "")


def training_run_from_proto(msg: pb.TrainingRun) -> TrainingRun:
    """The registry keeps only the paths of a run's last checkpoints, so their time and size are None."""
    return TrainingRun(
        training_run_id=msg.training_run_id, base_model=msg.base_model,
        lora_config=lora_config_from_proto(msg.lora_config), created_at=_time_from_proto(msg.created_at),
        last_request_time=_time_from_proto(msg.last_request_time), user_metadata=dict(msg.user_metadata),
        last_checkpoint=Checkpoint.from_tinker_path(msg.last_checkpoint) if msg.last_checkpoint else None,
        last_sampler_checkpoint=(Checkpoint.from_tinker_path(msg.last_sampler_checkpoint)
                                 if msg.last_sampler_checkpoint else None))


def training_runs_to_proto(resp: TrainingRunsResponse) -> pb.ListTrainingRunsResponse:
    return pb.ListTrainingRunsResponse(training_runs=[training_run_to_proto(r) for r in resp.training_runs],
                                       total_count=resp.cursor.total_count)


def training_runs_from_proto(msg: pb.ListTrainingRunsResponse, limit: int, offset: int) -> TrainingRunsResponse:
    return TrainingRunsResponse(training_runs=[training_run_from_proto(r) for r in msg.training_runs],
                                cursor=Cursor(offset=offset, limit=limit, total_count=msg.total_count))


def checkpoints_to_proto(resp: CheckpointsListResponse) -> pb.ListRunCheckpointsResponse:
    return pb.ListRunCheckpointsResponse(checkpoints=[checkpoint_to_proto(c) for c in resp.checkpoints],
                                         total_count=resp.cursor.total_count if resp.cursor else len(resp.checkpoints))


def checkpoints_from_proto(msg: pb.ListRunCheckpointsResponse, limit: int | None = None, offset: int = 0
                           ) -> CheckpointsListResponse:
    """``limit`` None: an unpaged listing, which has no cursor (like Tinker's ``list_checkpoints``)."""
    return CheckpointsListResponse(
        checkpoints=[checkpoint_from_proto(c) for c in msg.checkpoints],
        cursor=None if limit is None else Cursor(offset=offset, limit=limit, total_count=msg.total_count))
