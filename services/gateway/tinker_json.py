"""The Tinker HTTP door's JSON shapes <-> the core's values.

In: LoRA and Adam settings with Tinker's defaults, and an ``/asample`` body as the core's ``SampleRequest``
(Tinker's ``SamplingParams`` mapped onto the proto through ``lathe.wire``, so both front doors read ``stop``
the same way; ``target_prompt_logprobs`` densified, -1 where a sparse one lists nothing; ``record_stability_info`` as
``SampleRequest.record``, which ``lathe.gateway.stability`` keeps); the optimizer family of a run and of a step
(AdamW or Dimuon), others refused by name.
Out: training runs, checkpoints, model info, session summaries, storage usage and capabilities in the field names
and types of Tinker's pydantic models (times as ISO-8601 strings), and the identity token of ``/auth/token``.
"""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from typing import Any

import numpy as np

from lathe import wire
from lathe.errors import InvalidArgument
from lathe.types import OPTIMIZERS, AdamParams, DimuonParams, LoraConfig, ParsedCheckpointTinkerPath, SamplingParams
from lathe.v1 import checkpoints_pb2 as cpb
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import tinker_public_pb2 as tp

from .json_fields import INT32_MAX, Fields
from .records import Run, Session
from .session_search import session_status
from .tinker_proto import target_ids


def iso(seconds: float) -> str | None:
    return datetime.fromtimestamp(seconds, UTC).isoformat() if seconds else None


def lora_config(f: Fields) -> pb.LoraConfig:
    """Tinker's ``lora_config``; an absent field takes the SDK type's default (``lathe.types.LoraConfig``)."""
    d = LoraConfig()
    return pb.LoraConfig(rank=f.get("rank", int, d.rank, int_max=INT32_MAX), seed=f.get("seed", int, d.seed),
                         train_mlp=f.get("train_mlp", bool, d.train_mlp),
                         train_attn=f.get("train_attn", bool, d.train_attn),
                         train_unembed=f.get("train_unembed", bool, d.train_unembed))


def _number(f: Fields, name: str, default: float) -> float:
    """A number the SDK's type requires: absent takes ``default``; ``null`` (the SDK's NaN or infinity) is refused."""
    return f.get(name, float, default, nullable=False)


def adam_params(f: Fields) -> pb.AdamParams:
    """Tinker's ``adam_params``; an absent field takes the SDK type's default (``lathe.types.AdamParams``), and an
    explicit ``null`` (NaN or an infinity in the SDK) is refused by name."""
    d = AdamParams()
    return pb.AdamParams(learning_rate=_number(f, "learning_rate", d.learning_rate),
                         beta1=_number(f, "beta1", d.beta1), beta2=_number(f, "beta2", d.beta2),
                         eps=_number(f, "eps", d.eps), weight_decay=_number(f, "weight_decay", d.weight_decay),
                         grad_clip_norm=_number(f, "grad_clip_norm", d.grad_clip_norm))


def optimizer_family(f: Fields, name: str) -> str:
    """The optimizer family an optimizer config ``name`` selects (absent: AdamW); one Lathe lacks is refused."""
    family = f.sub(name, required=False).get("type", str, "adamw")
    if family not in OPTIMIZERS:
        raise InvalidArgument(f"{f.path(name)}.type = {family!r}: this server trains with {' or '.join(OPTIMIZERS)}")
    return family


SAMPLING_KINDS = ("snapshot", "inflight")  # tinker's SamplingClientKind


def sampling_kind(f: Fields) -> str:
    """A sampler save's ``kind``: ``"snapshot"`` (absent: the default) or ``"inflight"``; any other is refused."""
    kind = f.get("kind", str, "snapshot")
    if kind not in SAMPLING_KINDS:
        raise InvalidArgument(f"{f.path('kind')} = {kind!r}: a sampling client is 'snapshot' or 'inflight'")
    return kind


def optim_step(f: Fields) -> pb.OptimStepRequest:
    """An ``/optim_step`` body: ``adam_params``, or ``optimizer_params`` naming its family by ``type`` (tinker's
    ``DimuonParams``, whose learning_rate has no default)."""
    req = pb.OptimStepRequest(model_id=f.get("model_id", str), seq_id=f.get("seq_id", int))
    if f.get("optimizer_params", object, None) is None:
        req.adam_params.CopyFrom(adam_params(f.sub("adam_params", required=False)))
        return req
    g = f.sub("optimizer_params")
    family = optimizer_family(f, "optimizer_params")
    if family == "adamw":
        req.adam_params.CopyFrom(adam_params(g))
        return req
    d = DimuonParams(learning_rate=0.0)
    req.dimuon_params.CopyFrom(pb.DimuonParams(learning_rate=g.get("learning_rate", float, nullable=False),
                                               grad_clip_norm=_number(g, "grad_clip_norm", d.grad_clip_norm),
                                               beta1=_number(g, "beta1", d.beta1)))
    return req


def _prompt(f: Fields) -> list[int]:
    tokens: list[int] = []
    for j, raw in enumerate(f.get("chunks", list)):
        chunk = Fields(raw, f.path(f"chunks[{j}]"))
        kind = chunk.get("type", str, "encoded_text")
        if kind != "encoded_text":
            raise InvalidArgument(f"{chunk.path('type')} = {kind!r}: this server serves text models, whose "
                                  "prompts are encoded_text chunks")
        ids = chunk.get("tokens", list)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in ids):
            raise InvalidArgument(f"{chunk.path('tokens')} must be a list of token ids (integers in "
                                  f"[0, {INT32_MAX}])")
        tokens += ids
    return tokens


def _sampling_params(f: Fields) -> pb.SamplingParams:
    stop = f.get("stop", object, None)
    if not (stop is None or isinstance(stop, str | list)):
        raise InvalidArgument(f"{f.path('stop')} must be a string, a list of strings or a list of token ids")
    params = SamplingParams(max_tokens=f.get("max_tokens", int, None, int_max=INT32_MAX),
                            seed=f.get("seed", int, None), stop=stop, temperature=_number(f, "temperature", 1.0),
                            top_k=f.get("top_k", int, -1, int_max=INT32_MAX), top_p=_number(f, "top_p", 1.0))
    try:
        return wire.sampling_params_to_proto(params)
    except ValueError as e:
        raise InvalidArgument(f"{f.path('stop')}: {e}") from None


def _ints(f: Fields, name: str, lo: int, required: bool = False) -> list[int] | None:
    """The list of integers in [lo, INT32_MAX] at ``name``; None when it is absent (or null) and not required."""
    values = f.get(name, list) if required else f.get(name, object, None)
    if values is None:
        return None
    if not (isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= INT32_MAX
                                             for v in values)):
        raise InvalidArgument(f"{f.path(name)} must be a list of integers in [{lo}, {INT32_MAX}]")
    return values


def _target_ids(f: Fields, max_elements: int) -> tuple[pb.Tensor, tp.SparseCsr | None]:
    """``target_prompt_logprobs`` (Tinker's JSON ``TensorData``, dense or sparse CSR) as dense int64 ids, and
    the sparse layout its answer must keep (None: dense)."""
    dtype = f.get("dtype", str)
    if dtype != "int64":
        raise InvalidArgument(f"{f.path('dtype')} = {dtype!r}: target_prompt_logprobs holds token ids ('int64')")
    data, shape = _ints(f, "data", -1, required=True), _ints(f, "shape", 0, required=True)
    crow, col = _ints(f, "sparse_crow_indices", 0), _ints(f, "sparse_col_indices", 0)
    t = tp.Tensor(dtype=tp.DTYPE_INT64, shape=shape)
    if crow is None and col is None:
        t.dense = np.asarray(data, "<i8").tobytes()
    elif crow is None or col is None:
        raise InvalidArgument(f"{f.path('sparse_crow_indices')} and {f.path('sparse_col_indices')} go together")
    else:
        t.sparse_csr.CopyFrom(tp.SparseCsr(values=np.asarray(data, "<i8").tobytes(),
                                           crow_indices=np.asarray(crow, "<i8").tobytes(),
                                           col_indices=np.asarray(col, "<i8").tobytes()))
    return target_ids(t, max_elements), (t.sparse_csr if crow is not None else None)


def sample_request(f: Fields, max_elements: int) -> tuple[pb.SampleRequest, tp.SparseCsr | None]:
    """The core's request for an ``/asample`` body, and the layout of its ``target_prompt_logprobs`` when they
    came sparse (the answer keeps it); the ids may hold ``max_elements`` cells once dense."""
    req = pb.SampleRequest(sampling_session_id=f.get("sampling_session_id", str), seq_id=f.get("seq_id", int, 0),
                           prompt=_prompt(f.sub("prompt")), params=_sampling_params(f.sub("sampling_params")),
                           num_samples=f.get("num_samples", int, 1, int_max=INT32_MAX),
                           prompt_logprobs=f.get("prompt_logprobs", bool, False),
                           topk_prompt_logprobs=f.get("topk_prompt_logprobs", int, 0, int_max=INT32_MAX),
                           topk_sample_logprobs=f.get("topk_sample_logprobs", int, 0, int_max=INT32_MAX),
                           prompt_alt_tokens_k=f.get("prompt_alt_tokens_k", int, 0, int_max=INT32_MAX),
                           prompt_logprobs_last_n=f.get("prompt_logprobs_last_n", int, None, int_max=INT32_MAX),
                           record=f.get("record_stability_info", bool, False) or False)
    layout = None
    raw = f.get("target_prompt_logprobs", object, None)
    if raw is not None:
        ids, layout = _target_ids(Fields(raw, f.path("target_prompt_logprobs")), max_elements)
        req.target_prompt_logprobs.CopyFrom(ids)
    return req, layout


def _checkpoint_ref(path: str, seconds: float) -> dict[str, Any] | None:
    """A run's last checkpoint, from its path (``tinker://<run>/<kind>/<name>``) and save time."""
    if not path:
        return None
    parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
    return {"checkpoint_id": parsed.checkpoint_id, "checkpoint_type": parsed.checkpoint_type, "time": iso(seconds),
            "tinker_path": path}


def training_run(run: Run) -> dict[str, Any]:
    return {"training_run_id": run.model_id, "base_model": run.base_model, "model_owner": run.tenant,
            "is_lora": True, "lora_rank": run.lora.rank, "corrupted": False,
            "last_request_time": iso(run.last_request_time),
            "last_checkpoint": _checkpoint_ref(run.last_checkpoint, run.last_checkpoint_time),
            "last_sampler_checkpoint": _checkpoint_ref(run.last_sampler_checkpoint, run.last_sampler_checkpoint_time),
            "user_metadata": run.user_metadata}


def checkpoint(c: pb.CheckpointEntry) -> dict[str, Any]:
    return {"checkpoint_id": c.checkpoint_id, "checkpoint_type": c.checkpoint_type, "time": iso(c.time),
            "tinker_path": c.tinker_path, "size_bytes": c.size_bytes, "public": c.public,
            "expires_at": iso(c.expires_at), "user_metadata": dict(c.user_metadata) or None}


def session_summary(s: Session, checkpoints: list[cpb.CheckpointInfo]) -> dict[str, Any]:
    """A ``SessionSummary`` (``/sessions/search``); ``checkpoints``: the live ones of the session's runs. Lathe has
    no projects (``project_id`` is "")."""
    kind, reason = session_status(s)
    status = {"type": kind, "reason": {"type": reason}} if reason else {"type": kind} if kind else None
    return {"session_id": s.session_id, "created_at": iso(s.created_at), "owner": s.tenant, "project_id": "",
            "status": status, "checkpoints_count": len(checkpoints), "user_metadata": s.user_metadata,
            "checkpoint_storage_bytes": sum(c.size_bytes for c in checkpoints), "display_name": s.display_name}


def storage_usage(tenant: str, count: int, size: int) -> dict[str, Any]:
    """A ``CurrentCheckpointStorageUsageResponse`` of the tenant's ``count`` live checkpoints of ``size`` bytes in
    all (``Registry.storage_usage``): one row (none without checkpoints); Lathe prices nothing."""
    rows = [{"org_user_urn": tenant, "user_name": tenant, "checkpoint_count": count, "size_bytes": size,
             "size_gigabytes": size / 1e9}] if count else []
    return {"effective_rate_usd_per_gigabyte_month": None, "data": rows}


def identity_token(tenant: str, now: float, lifetime_s: int = 3600) -> str:
    """What ``/auth/token`` answers: a JWT in form only (``alg`` "none", no signature) whose claims name the caller
    (``sub``) and a lifetime (``iat``, ``exp``), which is all the SDK reads of one. Lathe authenticates API keys
    only and says so (``pjwt_auth_enabled`` false), so no SDK sends it back; presented as a key it is refused
    like any other that lacks the ``tml-`` prefix."""
    def part(obj: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj, separators=(",", ":")).encode()).rstrip(b"=").decode()

    claims = {"iss": "lathe", "sub": tenant, "iat": int(now), "exp": int(now) + lifetime_s}
    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(claims)}."


def weights_info(info: pb.WeightsInfo) -> dict[str, Any]:
    """A ``WeightsInfoResponse``; the module flags and ``optimizer_config`` only where the core knows them."""
    out: dict[str, Any] = {"base_model": info.base_model, "is_lora": info.is_lora,
                           "lora_rank": info.lora_rank if info.HasField("lora_rank") else None}
    if info.HasField("train_mlp"):
        out |= {"train_mlp": info.train_mlp, "train_attn": info.train_attn, "train_unembed": info.train_unembed,
                "optimizer_config": {"type": info.optimizer}}
    return out


def cursor(offset: int, limit: int, total: int) -> dict[str, int]:
    return {"offset": offset, "limit": limit, "total_count": total}


def model_info(info: pb.ModelInfo) -> dict[str, Any]:
    return {"model_id": info.model_id, "is_lora": True, "lora_rank": info.lora_config.rank,
            "model_name": info.base_model, "optimizer_config": {"type": info.optimizer or OPTIMIZERS[0]},
            "model_data": {"model_name": info.base_model, "tokenizer_id": info.tokenizer_id}}


def capabilities(caps: pb.ServerCapabilities) -> dict[str, Any]:
    """Tinker's shape, plus ``limits`` (what one request may ask for), which Tinker's SDK ignores."""
    limits = {f.name: getattr(caps.limits, f.name) for f in caps.limits.DESCRIPTOR.fields}
    return {"supported_models": [{"model_name": m.model_name, "max_context_length": m.max_context_length,
                                  "trainable": True, "sampleable": True} for m in caps.supported_models],
            "limits": limits}
