"""Where the sampler engine meets protobuf, both ways: nothing past this module reads or builds a ``pb`` message.

    Ask.of(SampleRequest)                 who asks, for what policy: request_id, seq_id, tenant, base model, adapter
    validate.check_sample(SampleRequest)  what is asked (prompt, params, options) -> Plan, on the loader thread
                                          once the base model's limits are known
    answer(receipt, prompt, samples)      a finished request -> SampleResult (its output)
    failure(receipt, error)               a failed one -> SampleResult (its error)
    capabilities(models, max_tokens)      what the pool serves -> ServerCapabilities

Owns the plain forms in between: ``Ask``, the ``PromptScores`` a prefill computed and the ``Sampled`` record of
each sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lathe.errors import LatheError
from lathe.sampler.step import ItemOut
from lathe.types import Receipt, TensorData
from lathe.v1 import lathe_pb2 as pb
from lathe.wire import error_to_proto, receipt_to_proto, tensor_to_proto


@dataclass(frozen=True, slots=True)
class Ask:
    """A sample request's identity and policy: its ids, its tenant, and which weights sample it (the base model
    alone, or the adapter saved at ``model_path`` as of ``model_version``)."""

    request_id: str
    seq_id: int
    tenant: str
    base_model: str
    model_path: str
    model_version: float

    @classmethod
    def of(cls, req: pb.SampleRequest) -> Ask:
        return cls(req.request_id, req.seq_id, req.tenant, req.base_model, req.model_path, req.model_version)

    @property
    def policy(self) -> str:
        """What sampled it, as ``SampledSequence.policy_version`` names it: the adapter's path, else the base."""
        return self.model_path or self.base_model


@dataclass(frozen=True, slots=True)
class PromptScores:
    """What a request's prefill computed about its prompt (``step.ItemOut``'s prompt fields; None: not asked)."""

    logprobs: torch.Tensor | None  # [L-1]: NaN before the first scored token
    topk_ids: torch.Tensor | None  # [n, K] for the last n prompt tokens scored
    topk_logprobs: torch.Tensor | None
    target_logprobs: torch.Tensor | None
    alt_tokens: torch.Tensor | None
    alt_logprobs: torch.Tensor | None

    @classmethod
    def of(cls, out: ItemOut) -> PromptScores:
        return cls(out.prompt_logprobs, out.topk_ids, out.topk_logprobs, out.target_logprobs, out.alt_tokens,
                   out.alt_logprobs)


@dataclass(slots=True)
class Sampled:
    """One sequence's tokens so far, each with its logprob and (when asked) its top-k ``(ids, logprobs)``."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[tuple[list[int], list[float]]] = field(default_factory=list)
    stop_reason: str = ""  # "stop" or "length" once finished


def answer(receipt: Receipt, ask: Ask, prompt_len: int, prompt: PromptScores | None, samples: list[Sampled]
           ) -> pb.SampleResult:
    """The result of a finished request of a ``prompt_len``-token prompt (``prompt``: its prefill's scores)."""
    out = pb.SampleOutput()
    if prompt is not None:
        _prompt_scores(out, prompt_len, prompt)
    out.sequences.extend(
        pb.SampledSequence(tokens=s.tokens, logprobs=s.logprobs, stop_reason=s.stop_reason,
                           policy_version=ask.policy,
                           topk_logprobs=[pb.TopkLogprobs(token_ids=i, logprobs=lp) for i, lp in s.topk])
        for s in samples
    )
    return pb.SampleResult(receipt=receipt_to_proto(receipt), sample=out)


def failure(receipt: Receipt, error: LatheError) -> pb.SampleResult:
    return pb.SampleResult(receipt=receipt_to_proto(receipt), error=error_to_proto(error))


def _prompt_scores(out: pb.SampleOutput, prompt_len: int, scores: PromptScores) -> None:
    """The prompt options a prefill computed, as ``SampleOutput`` carries them: one entry per prompt token (the
    first, and those before ``prompt_logprobs_last_n``, unscored: NaN, or an empty top-k)."""
    if scores.logprobs is not None:
        out.prompt_logprobs.extend([math.nan, *scores.logprobs.tolist()])
    if scores.topk_ids is not None:
        unscored = prompt_len - len(scores.topk_ids)
        out.topk_prompt_logprobs.extend(pb.TopkLogprobs() for _ in range(unscored))
        for ids, lps in zip(scores.topk_ids.tolist(), scores.topk_logprobs.tolist(), strict=True):
            out.topk_prompt_logprobs.append(pb.TopkLogprobs(token_ids=ids, logprobs=lps))
    if scores.target_logprobs is not None:
        out.target_prompt_logprobs.CopyFrom(tensor_to_proto(TensorData.from_torch(scores.target_logprobs)))
    if scores.alt_tokens is not None:
        out.prompt_alt_tokens.CopyFrom(pb.PromptAltTokens(
            tokens=tensor_to_proto(TensorData.from_torch(scores.alt_tokens)),
            logprobs=tensor_to_proto(TensorData.from_torch(scores.alt_logprobs))))


def capabilities(models: list[tuple[str, int, dict[str, object]]], max_sample_tokens: int) -> pb.ServerCapabilities:
    """``models``: ``(name, max_context_length, Exactness fields)`` of each model the pool serves."""
    return pb.ServerCapabilities(supported_models=[
        pb.SupportedModel(model_name=name, max_context_length=context, sampler_exactness=pb.Exactness(**exactness))
        for name, context, exactness in models
    ], limits=pb.RequestLimits(max_sample_tokens=max_sample_tokens))
