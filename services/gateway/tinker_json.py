"""The Tinker HTTP door's JSON shapes <-> the core's values.

In: LoRA and Adam settings with Tinker's defaults, and an ``/asample`` body as the core's ``SampleRequest``
(Tinker's ``SamplingParams`` mapped onto the proto through ``lathe.wire``, so both front doors read ``stop``
the same way); optimizer families and sampling features this server does not serve are refused by name.
Out: training runs, checkpoints, model info and capabilities in the field names and types of Tinker's
pydantic models (times as ISO-8601 strings).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from lathe import wire
from lathe.errors import InvalidArgument
from lathe.types import SamplingParams
from lathe.v1 import lathe_pb2 as pb

from .core import Run
from .json_fields import INT32_MAX, Fields

_CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler"}
# Request fields the sampler has no counterpart for, each with the value that asks for nothing.
_UNSERVED = {"topk_sample_logprobs": 0, "prompt_alt_tokens_k": 0, "target_prompt_logprobs": None,
             "record_stability_info": False}


def iso(seconds: float) -> str | None:
    return datetime.fromtimestamp(seconds, UTC).isoformat() if seconds else None


def lora_config(f: Fields) -> pb.LoraConfig:
    return pb.LoraConfig(rank=f.get("rank", int, 32, int_max=INT32_MAX), seed=f.get("seed", int, None),
                         train_mlp=f.get("train_mlp", bool, True), train_attn=f.get("train_attn", bool, True),
                         train_unembed=f.get("train_unembed", bool, True))


def adam_params(f: Fields) -> pb.AdamParams:
    return pb.AdamParams(learning_rate=f.get("learning_rate", float, 1e-4), beta1=f.get("beta1", float, 0.9),
                         beta2=f.get("beta2", float, 0.95), eps=f.get("eps", float, 1e-12),
                         weight_decay=f.get("weight_decay", float, 0.0),
                         grad_clip_norm=f.get("grad_clip_norm", float, 0.0))


def check_adamw(f: Fields, name: str) -> None:
    """Lathe trains with AdamW only: an optimizer config ``name`` naming another family is refused."""
    family = f.sub(name, required=False).get("type", str, "adamw")
    if family != "adamw":
        raise InvalidArgument(f"{f.path(name)}.type = {family!r}: this server trains with 'adamw' only")


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
                            seed=f.get("seed", int, None), stop=stop, temperature=f.get("temperature", float, 1.0),
                            top_k=f.get("top_k", int, -1, int_max=INT32_MAX), top_p=f.get("top_p", float, 1.0))
    try:
        return wire.sampling_params_to_proto(params)
    except ValueError as e:
        raise InvalidArgument(f"{f.path('stop')}: {e}") from None


def sample_request(f: Fields) -> tuple[pb.SampleRequest, int | None]:
    """The core's request for an ``/asample`` body, and its ``prompt_logprobs_last_n`` (None: all)."""
    for name, off in _UNSERVED.items():
        if f.get(name, object, off) != off:
            raise InvalidArgument(f"{name} is not supported by this server; leave it at {off!r}")
    req = pb.SampleRequest(sampling_session_id=f.get("sampling_session_id", str), seq_id=f.get("seq_id", int, 0),
                           prompt=_prompt(f.sub("prompt")), params=_sampling_params(f.sub("sampling_params")),
                           num_samples=f.get("num_samples", int, 1, int_max=INT32_MAX),
                           prompt_logprobs=f.get("prompt_logprobs", bool, False),
                           topk_prompt_logprobs=f.get("topk_prompt_logprobs", int, 0, int_max=INT32_MAX))
    last_n = f.get("prompt_logprobs_last_n", int, None)
    if last_n is not None and not (req.prompt_logprobs or req.topk_prompt_logprobs):
        raise InvalidArgument("prompt_logprobs_last_n needs prompt_logprobs")
    if last_n is not None and not 1 <= last_n <= len(req.prompt) - 1:
        raise InvalidArgument(f"prompt_logprobs_last_n = {last_n} must be in [1, {len(req.prompt) - 1}] "
                              f"for a prompt of {len(req.prompt)} tokens")
    return req, last_n


def _checkpoint_ref(path: str, seconds: float) -> dict[str, Any] | None:
    """A run's last checkpoint, from its path (``tinker://<run>/<kind>/<name>``) and save time."""
    if not path:
        return None
    kind, name = path.removeprefix("tinker://").split("/")[1:]
    return {"checkpoint_id": f"{kind}/{name}", "checkpoint_type": _CHECKPOINT_TYPES[kind], "time": iso(seconds),
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
            "tinker_path": c.tinker_path, "size_bytes": c.size_bytes, "public": False,
            "expires_at": iso(c.expires_at), "user_metadata": dict(c.user_metadata) or None}


def cursor(offset: int, limit: int, total: int) -> dict[str, int]:
    return {"offset": offset, "limit": limit, "total_count": total}


def model_info(info: pb.ModelInfo) -> dict[str, Any]:
    return {"model_id": info.model_id, "is_lora": True, "lora_rank": info.lora_config.rank,
            "model_name": info.base_model, "optimizer_config": {"type": "adamw"},
            "model_data": {"model_name": info.base_model, "tokenizer_id": info.tokenizer_id}}


def capabilities(caps: pb.ServerCapabilities) -> dict[str, Any]:
    """Tinker's shape, plus ``limits`` (what one request may ask for), which Tinker's SDK ignores."""
    limits = {f.name: getattr(caps.limits, f.name) for f in caps.limits.DESCRIPTOR.fields}
    return {"supported_models": [{"model_name": m.model_name, "max_context_length": m.max_context_length,
                                  "trainable": True, "sampleable": True} for m in caps.supported_models],
            "limits": limits}
