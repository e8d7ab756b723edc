"""Checks of a ``SampleRequest`` against its base model, before anything is queued or computed.

``check_sample`` returns a ``Plan`` or raises ``lathe.errors.InvalidArgument`` naming the field and
value at fault. Defaults: no ``params`` at all means Tinker's ``SamplingParams()`` (temperature 1, no
top-k / top-p, stop at EOS); an unset ``max_tokens`` means "up to the end of the context".
EOS ends a sequence when ``use_eos`` is set or when any stop string or stop token id is given
(Tinker: ``stop=None`` stops at EOS, ``stop=[]`` never stops early).
A request's reservation, ``num_samples x (prompt + max_tokens)`` tokens, must fit in the pool's running
budget: a larger one could never be admitted.
The prompt options become a ``step.PromptAsk``: ``prompt_logprobs_last_n`` needs prompt logprobs and is in
[1, len(prompt) - 1]; ``target_prompt_logprobs`` is an int64 ``[len(prompt) - 1, K]`` tensor of ids in
[-1, vocab) naming at least one id; the top-k widths are in [0, vocab]. How many a request may ask for is the
gateway's limit (``lathe.gateway.limits``), not the sampler's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lathe.errors import InvalidArgument
from lathe.models.config import ModelConfig
from lathe.sampler.sampling import Rule, random_seed
from lathe.sampler.step import PromptAsk
from lathe.sampler.stops import StopRule
from lathe.v1 import lathe_pb2 as pb
from lathe.wire import tensor_from_proto

MAX_SAMPLES = 128

DEFAULT_PARAMS = pb.SamplingParams(temperature=1.0, top_k=0, top_p=1.0, use_eos=True)


@dataclass(frozen=True, slots=True)
class ModelLimits:
    name: str
    vocab_size: int
    max_context: int
    eos_ids: tuple[int, ...]
    tokenizer: Tokenizer | None

    @classmethod
    def of(cls, name: str, cfg: ModelConfig, directory: Path, max_context_length: int) -> ModelLimits:
        """The limits of base model ``name`` (config ``cfg``, files in ``directory``; its catalog entry's context
        length, 0 for the model's own), with its tokenizer where the directory has one."""
        tok = directory / "tokenizer.json"
        return cls(name=name, vocab_size=cfg.vocab_size, eos_ids=cfg.eos_token_ids,
                   max_context=min(max_context_length or cfg.max_position_embeddings, cfg.max_position_embeddings),
                   tokenizer=Tokenizer.from_file(str(tok)) if tok.exists() else None)


@dataclass(frozen=True, slots=True)
class Plan:
    """A checked request: what to prefill, how many sequences, how to pick and stop them."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    rule: Rule
    seed: int
    stop: StopRule
    ask: PromptAsk | None  # the prompt options; None: none asked
    topk_sample: int  # topk_sample_logprobs

    @property
    def reserved_tokens(self) -> int:
        """The most tokens its sequences can hold together: every sample runs to ``max_tokens``."""
        return self.num_samples * (len(self.prompt) + self.max_tokens)


def _check_ids(ids: Sequence[int], field: str, vocab: int) -> None:
    for j, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise InvalidArgument(f"{field}[{j}] = {t} is outside the vocabulary [0, {vocab})")


def check_sample(req: pb.SampleRequest, m: ModelLimits, budget: int) -> Plan:
    """``req`` checked against model ``m`` and the pool's running ``budget`` (tokens)."""
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
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        if not 0 <= getattr(req, name) <= m.vocab_size:
            raise InvalidArgument(f"{name} = {getattr(req, name)} must be in [0, {m.vocab_size}]")
    _check_ids(p.stop_token_ids, "params.stop_token_ids", m.vocab_size)
    for j, s in enumerate(p.stop_strings):
        if not s:
            raise InvalidArgument(f"params.stop_strings[{j}] is empty")
    if p.stop_strings and m.tokenizer is None:
        raise InvalidArgument(f"params.stop_strings needs a tokenizer and {m.name!r} has no tokenizer.json")
    ids = set(p.stop_token_ids)
    if p.use_eos or p.stop_strings or p.stop_token_ids:
        ids.update(m.eos_ids)
    seed = p.seed if p.HasField("seed") else random_seed()
    plan = Plan(
        prompt=prompt, num_samples=req.num_samples, max_tokens=max_tokens,
        rule=Rule(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p), seed=seed,
        stop=StopRule(frozenset(ids), tuple(p.stop_strings), m.tokenizer if p.stop_strings else None),
        ask=_prompt_ask(req, m.vocab_size, p.temperature, seed), topk_sample=req.topk_sample_logprobs,
    )
    if plan.reserved_tokens > budget:
        raise InvalidArgument(f"num_samples ({req.num_samples}) x (prompt ({n} tokens) + max_tokens ({max_tokens})) = "
                              f"{plan.reserved_tokens} tokens is over this sampler pool's running budget of {budget} "
                              "tokens; ask for fewer samples or tokens")
    return plan


def _targets(req: pb.SampleRequest, vocab: int) -> torch.Tensor:
    rows = len(req.prompt) - 1
    msg = req.target_prompt_logprobs
    if msg.dtype != "int64" or len(msg.shape) != 2 or msg.shape[0] != rows:
        raise InvalidArgument(f"target_prompt_logprobs has dtype {msg.dtype!r} and shape {list(msg.shape)}; it "
                              f"must be int64 token ids of shape [len(prompt) - 1, K] = [{rows}, K]")
    try:
        ids = torch.from_numpy(tensor_from_proto(msg).to_numpy())
    except ValueError as e:
        raise InvalidArgument(f"target_prompt_logprobs: {e}") from None
    bad = (ids < -1) | (ids >= vocab)
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        raise InvalidArgument(f"target_prompt_logprobs[{i}, {j}] = {int(ids[i, j])} is neither -1 nor in the "
                              f"vocabulary [0, {vocab})")
    if not bool((ids >= 0).any()):
        raise InvalidArgument("target_prompt_logprobs names no token id (every cell is -1)")
    return ids


def _prompt_ask(req: pb.SampleRequest, vocab: int, temperature: float, seed: int) -> PromptAsk | None:
    """The prompt options of ``req`` (None when it asks for none)."""
    rows = len(req.prompt) - 1
    scored_from = 0
    if req.HasField("prompt_logprobs_last_n"):
        last_n = req.prompt_logprobs_last_n
        if not (req.prompt_logprobs or req.topk_prompt_logprobs):
            raise InvalidArgument(f"prompt_logprobs_last_n = {last_n} needs prompt_logprobs (it picks which prompt "
                                  "tokens to score)")
        if not 1 <= last_n <= rows:
            raise InvalidArgument(f"prompt_logprobs_last_n = {last_n} must be in [1, {rows}] for a prompt of "
                                  f"{rows + 1} tokens")
        scored_from = rows - last_n
    if req.prompt_alt_tokens_k < 0:
        raise InvalidArgument(f"prompt_alt_tokens_k = {req.prompt_alt_tokens_k} must be >= 0")
    targets = _targets(req, vocab) if req.HasField("target_prompt_logprobs") else None
    if not (req.prompt_logprobs or req.topk_prompt_logprobs or targets is not None or req.prompt_alt_tokens_k):
        return None
    return PromptAsk(logprobs=req.prompt_logprobs, topk=req.topk_prompt_logprobs, scored_from=scored_from,
                     targets=targets, alt_k=req.prompt_alt_tokens_k, alt_temperature=temperature, alt_seed=seed)
