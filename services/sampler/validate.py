"""Checks of a ``SampleRequest`` against its base model, before anything is queued or computed.

``check_sample`` returns a ``Plan`` or raises ``lathe.errors.InvalidArgument`` naming the field and
value at fault. Defaults: no ``params`` at all means Tinker's ``SamplingParams()`` (temperature 1, no
top-k / top-p, stop at EOS); an unset ``max_tokens`` means "up to the end of the context".
EOS ends a sequence when ``use_eos`` is set or when any stop string or stop token id is given
(Tinker: ``stop=None`` stops at EOS, ``stop=[]`` never stops early).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from lathe.errors import InvalidArgument
from lathe.sampler.sampling import Rule, random_seed
from lathe.sampler.stops import StopRule
from lathe.v1 import lathe_pb2 as pb

MAX_SAMPLES = 128

DEFAULT_PARAMS = pb.SamplingParams(temperature=1.0, top_k=0, top_p=1.0, use_eos=True)


@dataclass(frozen=True, slots=True)
class ModelLimits:
    name: str
    vocab_size: int
    max_context: int
    eos_ids: tuple[int, ...]
    tokenizer: Tokenizer | None


@dataclass(frozen=True, slots=True)
class Plan:
    """A checked request: what to prefill, how many sequences, how to pick and stop them."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    rule: Rule
    seed: int
    stop: StopRule
    prompt_logprobs: bool
    topk_prompt: int


def _check_ids(ids: Sequence[int], field: str, vocab: int) -> None:
    for j, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise InvalidArgument(f"{field}[{j}] = {t} is outside the vocabulary [0, {vocab})")


def check_sample(req: pb.SampleRequest, m: ModelLimits) -> Plan:
    p = req.params if req.HasField("params") else DEFAULT_PARAMS
    prompt = list(req.prompt)
    n, ctx = len(prompt), m.max_context
    if not prompt:
        raise InvalidArgument("prompt is empty: sampling needs at least one prompt token")
    if n > ctx:
        raise InvalidArgument(f"prompt has {n} tokens, over the context length {ctx} of {m.name!r}")
    _check_ids(prompt, "prompt", m.vocab_size)
    if not 1 <= req.num_samples <= MAX_SAMPLES:
        raise InvalidArgument(f"num_samples = {req.num_samples} must be in [1, {MAX_SAMPLES}]")
    if p.HasField("max_tokens"):
        max_tokens = p.max_tokens
        if max_tokens <= 0:
            raise InvalidArgument(f"params.max_tokens = {max_tokens} must be >= 1")
        if n + max_tokens > ctx:
            raise InvalidArgument(f"prompt ({n} tokens) + params.max_tokens ({max_tokens}) = {n + max_tokens} is "
                                  f"over the context length {ctx} of {m.name!r}")
    else:
        max_tokens = ctx - n
        if max_tokens <= 0:
            raise InvalidArgument(f"prompt has {n} tokens and fills the context length {ctx} of {m.name!r}: "
                                  "no room to sample")
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        raise InvalidArgument(f"params.temperature = {p.temperature} must be a finite number >= 0 (0 is greedy)")
    if not 0 < p.top_p <= 1:
        raise InvalidArgument(f"params.top_p = {p.top_p} must be in (0, 1] (1.0 turns it off)")
    if not 0 <= req.topk_prompt_logprobs <= m.vocab_size:
        raise InvalidArgument(f"topk_prompt_logprobs = {req.topk_prompt_logprobs} must be in [0, {m.vocab_size}]")
    _check_ids(p.stop_token_ids, "params.stop_token_ids", m.vocab_size)
    for j, s in enumerate(p.stop_strings):
        if not s:
            raise InvalidArgument(f"params.stop_strings[{j}] is empty")
    if p.stop_strings and m.tokenizer is None:
        raise InvalidArgument(f"params.stop_strings needs a tokenizer and {m.name!r} has no tokenizer.json")
    ids = set(p.stop_token_ids)
    if p.use_eos or p.stop_strings or p.stop_token_ids:
        ids.update(m.eos_ids)
    return Plan(
        prompt=prompt, num_samples=req.num_samples, max_tokens=max_tokens,
        rule=Rule(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p),
        seed=p.seed if p.HasField("seed") else random_seed(),
        stop=StopRule(frozenset(ids), tuple(p.stop_strings), m.tokenizer if p.stop_strings else None),
        prompt_logprobs=req.prompt_logprobs, topk_prompt=req.topk_prompt_logprobs,
    )
