"""Conversions between ``lathe.types`` values and ``lathe.v1`` messages, both directions: training and sampling
data, configurations, errors and the results of futures.

The clients (``service_client``, ``training_client``, ``sampling_client``) use the ``*_to_proto`` functions to
build requests and the ``*_from_proto`` ones to read replies; the other direction of each pair is what a
server (or a test's fake gateway) uses to answer. Tensors travel as raw little-endian bytes. The views of models
and runs (info, capabilities, training runs, checkpoint listings) are ``lathe.info_wire``'s.

A finished ``FutureResult`` becomes the result type the caller expects (``result_from_proto``), or the
``lathe.errors`` class named by its ``Error.code`` is raised.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from lathe import errors
from lathe.types import (
    NUMPY_DTYPES,
    AdamParams,
    CreateModelResponse,
    Datum,
    DimuonParams,
    EncodedTextChunk,
    ForwardBackwardOutput,
    LoadWeightsResponse,
    LoraConfig,
    ModelInput,
    OptimParams,
    OptimStepResponse,
    PromptAltTokens,
    Receipt,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
)
from lathe.v1 import lathe_pb2 as pb

R = TypeVar("R")

# ---------- data ----------


def tensor_to_proto(t: TensorData) -> pb.Tensor:
    arr = t.to_numpy()
    return pb.Tensor(data=arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes(), dtype=t.dtype,
                     shape=list(arr.shape))


def tensor_from_proto(msg: pb.Tensor) -> TensorData:
    if msg.dtype not in NUMPY_DTYPES:
        raise errors.InvalidArgument(f"Tensor.dtype = {msg.dtype!r}; expected one of {sorted(NUMPY_DTYPES)}")
    dtype = np.dtype(NUMPY_DTYPES[msg.dtype]).newbyteorder("<")
    if len(msg.data) % dtype.itemsize:
        raise errors.InvalidArgument(f"Tensor of dtype {msg.dtype} has {len(msg.data)} bytes, "
                                     f"not a multiple of {dtype.itemsize}")
    flat = np.frombuffer(msg.data, dtype=dtype).astype(NUMPY_DTYPES[msg.dtype])  # a writable native copy
    return TensorData(data=flat, dtype=msg.dtype, shape=list(msg.shape))


def model_input_to_proto(mi: ModelInput) -> pb.ModelInput:
    return pb.ModelInput(chunks=[pb.ModelInputChunk(tokens=c.tokens) for c in mi.chunks])


def model_input_from_proto(msg: pb.ModelInput) -> ModelInput:
    return ModelInput(chunks=[EncodedTextChunk(tokens=list(c.tokens)) for c in msg.chunks])


def _tensors_to_proto(tensors: dict[str, TensorData]) -> dict[str, pb.Tensor]:
    return {k: tensor_to_proto(v) for k, v in tensors.items()}


def _tensors_from_proto(tensors: Any) -> dict[str, TensorData]:  # a protobuf map<string, Tensor>
    return {k: tensor_from_proto(v) for k, v in tensors.items()}


def datum_to_proto(d: Datum) -> pb.Datum:
    return pb.Datum(model_input=model_input_to_proto(d.model_input),
                    loss_fn_inputs=_tensors_to_proto(d.loss_fn_inputs))


def datum_from_proto(msg: pb.Datum) -> Datum:
    return Datum(model_input=model_input_from_proto(msg.model_input),
                 loss_fn_inputs=_tensors_from_proto(msg.loss_fn_inputs))


# ---------- configuration ----------


def lora_config_to_proto(c: LoraConfig) -> pb.LoraConfig:
    return pb.LoraConfig(rank=c.rank, seed=c.seed, train_mlp=c.train_mlp, train_attn=c.train_attn,
                         train_unembed=c.train_unembed, alpha=c.alpha)


def lora_config_from_proto(msg: pb.LoraConfig) -> LoraConfig:
    return LoraConfig(rank=msg.rank, seed=msg.seed if msg.HasField("seed") else None, train_mlp=msg.train_mlp,
                      train_attn=msg.train_attn, train_unembed=msg.train_unembed,
                      alpha=msg.alpha if msg.HasField("alpha") else None)


def adam_params_to_proto(p: AdamParams) -> pb.AdamParams:
    return pb.AdamParams(learning_rate=p.learning_rate, beta1=p.beta1, beta2=p.beta2, eps=p.eps,
                         weight_decay=p.weight_decay, grad_clip_norm=p.grad_clip_norm)


def adam_params_from_proto(msg: pb.AdamParams) -> AdamParams:
    return AdamParams(learning_rate=msg.learning_rate, beta1=msg.beta1, beta2=msg.beta2, eps=msg.eps,
                      weight_decay=msg.weight_decay, grad_clip_norm=msg.grad_clip_norm)


def optim_step_to_proto(model_id: str, params: OptimParams) -> pb.OptimStepRequest:
    """An optim_step carrying ``params`` in the field of its family (``adam_params`` or ``dimuon_params``)."""
    if isinstance(params, DimuonParams):
        return pb.OptimStepRequest(model_id=model_id, dimuon_params=pb.DimuonParams(
            learning_rate=params.learning_rate, grad_clip_norm=params.grad_clip_norm, beta1=params.beta1))
    return pb.OptimStepRequest(model_id=model_id, adam_params=adam_params_to_proto(params))


def optim_params_from_proto(msg: pb.OptimStepRequest) -> OptimParams:
    """The (unchecked) params of an optim_step: ``dimuon_params`` when set, else ``adam_params``."""
    if msg.HasField("dimuon_params"):
        d = msg.dimuon_params
        return DimuonParams(learning_rate=d.learning_rate, grad_clip_norm=d.grad_clip_norm, beta1=d.beta1)
    return adam_params_from_proto(msg.adam_params)


# ---------- errors ----------

ERROR_CLASSES: dict[str, type[errors.LatheError]] = {
    name: cls for name, cls in vars(errors).items()
    if isinstance(cls, type) and issubclass(cls, errors.LatheError)
}


def error_to_proto(err: errors.LatheError) -> pb.Error:
    return pb.Error(code=type(err).__name__, message=err.message, category=err.category)


def error_from_proto(msg: pb.Error) -> errors.LatheError:
    """The ``lathe.errors`` class named by ``code`` (an unknown code becomes ``Internal``)."""
    cls = ERROR_CLASSES.get(msg.code)
    if cls is None:
        return errors.Internal(f"{msg.code or 'error'}: {msg.message}")
    return cls(msg.message)


# ---------- results of futures ----------


def receipt_to_proto(r: Receipt) -> pb.Receipt:
    return pb.Receipt(request_id=r.request_id, model_id=r.model_id, seq_id=r.seq_id, cycle=r.cycle,
                      tokens=r.tokens, adapter_step=r.adapter_step, queued_s=r.queued_s, run_s=r.run_s,
                      dtype=r.dtype, op=r.op, fingerprint=r.fingerprint, exact=r.exact, policy=r.policy)


def receipt_from_proto(msg: pb.Receipt) -> Receipt:
    return Receipt(request_id=msg.request_id, model_id=msg.model_id, seq_id=msg.seq_id, cycle=msg.cycle,
                   tokens=msg.tokens, adapter_step=msg.adapter_step, queued_s=msg.queued_s, run_s=msg.run_s,
                   dtype=msg.dtype, op=msg.op, fingerprint=msg.fingerprint, exact=msg.exact, policy=msg.policy)


def forward_backward_output_to_proto(out: ForwardBackwardOutput) -> pb.ForwardBackwardOutput:
    return pb.ForwardBackwardOutput(
        loss_fn_output_type=out.loss_fn_output_type, metrics=out.metrics,
        loss_fn_outputs=[pb.LossFnOutput(tensors=_tensors_to_proto(o)) for o in out.loss_fn_outputs])


def forward_backward_output_from_proto(msg: pb.ForwardBackwardOutput, receipt: Receipt | None = None
                                       ) -> ForwardBackwardOutput:
    return ForwardBackwardOutput(
        loss_fn_output_type=msg.loss_fn_output_type, metrics=dict(msg.metrics), receipt=receipt,
        loss_fn_outputs=[_tensors_from_proto(o.tensors) for o in msg.loss_fn_outputs])


def sampling_params_to_proto(p: SamplingParams) -> pb.SamplingParams:
    """Tinker's ``stop`` forms onto the proto: None -> use_eos; [] -> nothing; strings; token ids."""
    stops: list = [] if p.stop is None else [p.stop] if isinstance(p.stop, str) else list(p.stop)
    if not all(isinstance(x, str) for x in stops) and not all(isinstance(x, int) for x in stops):
        raise ValueError(f"stop must be strings or token ids, not a mix: {p.stop!r}")
    msg = pb.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, use_eos=p.stop is None,
                            stop_strings=[x for x in stops if isinstance(x, str)],
                            stop_token_ids=[x for x in stops if isinstance(x, int)])
    if p.max_tokens is not None:
        msg.max_tokens = p.max_tokens
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def _topk_from_proto(entries: Any) -> list[list[tuple[int, float]] | None] | None:  # repeated TopkLogprobs
    return [list(zip(t.token_ids, t.logprobs, strict=True)) or None for t in entries] if entries else None


def _topk_to_proto(entries: list[list[tuple[int, float]] | None] | None) -> list[pb.TopkLogprobs]:
    return [pb.TopkLogprobs(token_ids=[t for t, _ in e or []], logprobs=[lp for _, lp in e or []])
            for e in entries or []]


def sample_response_from_proto(msg: pb.SampleOutput, receipt: Receipt | None = None) -> SampleResponse:
    seqs = [SampledSequence(stop_reason=s.stop_reason, tokens=list(s.tokens), logprobs=list(s.logprobs),
                            policy_version=s.policy_version, topk_logprobs=_topk_from_proto(s.topk_logprobs))
            for s in msg.sequences]
    prompt = [None if math.isnan(x) else x for x in msg.prompt_logprobs] if msg.prompt_logprobs else None
    alt = msg.prompt_alt_tokens
    return SampleResponse(
        sequences=seqs, prompt_logprobs=prompt, topk_prompt_logprobs=_topk_from_proto(msg.topk_prompt_logprobs),
        target_prompt_logprobs=(tensor_from_proto(msg.target_prompt_logprobs)
                                if msg.HasField("target_prompt_logprobs") else None),
        prompt_alt_tokens=(PromptAltTokens(tensor_from_proto(alt.tokens), tensor_from_proto(alt.logprobs))
                           if msg.HasField("prompt_alt_tokens") else None),
        receipt=receipt)


def sample_response_to_proto(r: SampleResponse) -> pb.SampleOutput:
    alt = r.prompt_alt_tokens
    return pb.SampleOutput(
        sequences=[pb.SampledSequence(stop_reason=s.stop_reason, tokens=s.tokens, logprobs=s.logprobs or [],
                                      policy_version=s.policy_version, topk_logprobs=_topk_to_proto(s.topk_logprobs))
                   for s in r.sequences],
        prompt_logprobs=[math.nan if x is None else x for x in r.prompt_logprobs or []],
        topk_prompt_logprobs=_topk_to_proto(r.topk_prompt_logprobs),
        target_prompt_logprobs=(tensor_to_proto(r.target_prompt_logprobs)
                                if r.target_prompt_logprobs is not None else None),
        prompt_alt_tokens=(pb.PromptAltTokens(tokens=tensor_to_proto(alt.tokens),
                                              logprobs=tensor_to_proto(alt.logprobs)) if alt is not None else None))


# Result type -> (FutureResult oneof field, payload decoder, payload encoder). Sampling adds its row here.
_RESULTS: dict[type, tuple[str, Callable[[Any, Receipt | None], Any], Callable[[Any], Any]]] = {
    ForwardBackwardOutput: ("forward_backward", forward_backward_output_from_proto,
                            forward_backward_output_to_proto),
    OptimStepResponse: ("optim_step", lambda m, r: OptimStepResponse(dict(m.metrics), r),
                        lambda v: pb.OptimStepOutput(metrics=v.metrics or {})),
    SaveWeightsResponse: ("save", lambda m, r: SaveWeightsResponse(m.path, r, m.console_url),
                          lambda v: pb.SaveOutput(path=v.path)),
    SaveWeightsForSamplerResponse: ("save", lambda m, r: SaveWeightsForSamplerResponse(m.path, r, m.console_url),
                                    lambda v: pb.SaveOutput(path=v.path)),
    SaveWeightsExternalResponse: ("save", lambda m, r: SaveWeightsExternalResponse(m.path, r),
                                  lambda v: pb.SaveOutput(path=v.path)),
    LoadWeightsResponse: ("load", lambda m, r: LoadWeightsResponse(m.path or None, m.model_id or None, r),
                          lambda v: pb.LoadOutput(path=v.path or "", model_id=v.model_id or "")),
    CreateModelResponse: ("create_model", lambda m, r: CreateModelResponse(m.model_id),
                          lambda v: pb.CreateModelOutput(model_id=v.model_id)),
    SampleResponse: ("sample", sample_response_from_proto, sample_response_to_proto),
}


def result_to_proto(value: Any, request_id: str = "") -> pb.FutureResult:
    """A finished ``FutureResult`` holding ``value`` (one of the result types) and its receipt."""
    field, _, encode = _RESULTS[type(value)]
    res = pb.FutureResult(request_id=request_id, done=True)
    getattr(res, field).CopyFrom(encode(value))
    receipt = getattr(value, "receipt", None)
    if receipt is not None:
        res.receipt.CopyFrom(receipt_to_proto(receipt))
    return res


def result_from_proto(res: pb.FutureResult, kind: type[R]) -> R:
    """The ``kind`` value a finished request produced; raises its error if it failed."""
    which = res.WhichOneof("result")
    if which == "error":
        raise error_from_proto(res.error)
    field, decode, _ = _RESULTS[kind]
    if which != field:
        raise errors.Internal(f"request {res.request_id!r} finished with a {which!r} result; "
                              f"expected {field!r} ({kind.__name__})")
    receipt = receipt_from_proto(res.receipt) if res.HasField("receipt") else None
    return decode(getattr(res, field), receipt)
