"""Lathe's checked sample request (``validate.Plan``) as SGLang's ``POST /generate`` body, and its answer back.

    generate_body(plan, lora)   -> {"input_ids": [prompt] x n, "sampling_params": [one per sample], "lora_path",
                                    "return_logprob": true, "logprob_start_len", "top_logprobs_num"}
    read_sample(plan, item)     one answer of the batch -> ``intake.Sampled`` (tokens, logprobs, top-k, stop reason)
    read_prompt(plan, item)     the first answer's prompt logprobs -> ``intake.PromptScores`` (None: none asked)
    server_error(url, ...)      a refused call -> the ``lathe.errors`` type its status means, with SGLang's message

The mapping, field by field (SGLang's names from ``GenerateReqInput`` and ``SamplingParams``):
  temperature, top_p             as they are (temperature 0: SGLang samples greedily)
  top_k                          0 (off) -> -1
  max_tokens                     max_new_tokens
  seed                           sample i of a request seeded s draws with ``sampling_seed = sample_seed(s, i)``
                                 (SGLang honours it under --enable-deterministic-inference)
  stop token ids, EOS            stop_token_ids (EOS among them when it applies); ignore_eos when EOS does not
  stop strings                   stop, with no_stop_trim; the answer's tokens are then cut by Lathe's own
                                 ``StopRule`` (the token that completes a string is kept), so both engines stop alike
  prompt_logprobs (_last_n),     logprob_start_len at the first scored row and top_logprobs_num = the wider of the
  topk_prompt/sample_logprobs    two top-k widths; each list is read aligned to the end of its tokens
Every answer's logprobs come from ``meta_info.output_token_logprobs`` / ``input_token_logprobs`` (entries
``[logprob, token_id, text]``) and its top-k from ``output_top_logprobs`` / ``input_top_logprobs``. SGLang reports
temperature-scaled logprobs unless its server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``; Lathe's are
untempered (docs/gpu.md). ``target_prompt_logprobs`` and ``prompt_alt_tokens_k`` have no SGLang counterpart and are
refused (``unsupported``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lathe.errors import InvalidArgument, LatheError, NotFound, Unavailable
from lathe.sampler.intake import PromptScores, Sampled
from lathe.sampler.sampling import sample_seed
from lathe.sampler.validate import Plan

Json = dict[str, Any]


def unsupported(plan: Plan) -> None:
    """Refuse the prompt options SGLang's API cannot answer, naming them."""
    ask = plan.ask
    if ask is not None and ask.targets is not None:
        raise InvalidArgument("target_prompt_logprobs is not served by this sampler pool (engine sglang: SGLang's "
                              "/generate scores only the prompt's own tokens); use a native pool")
    if ask is not None and ask.alt_k:
        raise InvalidArgument(f"prompt_alt_tokens_k = {ask.alt_k} is not served by this sampler pool (engine sglang "
                              "draws no prompt alternatives); use a native pool")


def _topk_width(plan: Plan) -> int:
    return max(plan.topk_sample, plan.ask.topk if plan.ask is not None else 0)


def sampling_params(plan: Plan, index: int) -> Json:
    """SGLang's ``sampling_params`` of sample ``index`` of ``plan``."""
    rule, stop = plan.rule, plan.stop
    params: Json = {"max_new_tokens": plan.max_tokens, "temperature": rule.temperature, "top_p": rule.top_p,
                    "top_k": rule.top_k if rule.top_k > 0 else -1, "sampling_seed": sample_seed(plan.seed, index),
                    "stop_token_ids": sorted(stop.ids), "ignore_eos": not stop.ids}
    if stop.strings:
        params |= {"stop": list(stop.strings), "no_stop_trim": True}
    return params


def generate_body(plan: Plan, lora: str | None) -> Json:
    """The ``/generate`` body of ``plan``: its samples as one batch, each with its own seed, all through adapter
    ``lora`` (a name the server loaded) or the base model (None)."""
    n, ask = plan.num_samples, plan.ask
    body: Json = {"input_ids": [list(plan.prompt)] * n,
                  "sampling_params": [sampling_params(plan, i) for i in range(n)],
                  "return_logprob": True, "top_logprobs_num": _topk_width(plan)}
    if ask is not None and (ask.logprobs or ask.topk):
        body["logprob_start_len"] = ask.scored_from
    if lora is not None:
        body["lora_path"] = [lora] * n
    return body


def _entries(meta: Json, key: str) -> list:
    value = meta.get(key)
    if not isinstance(value, list):
        raise Unavailable(f"the SGLang server's answer has no meta_info.{key} list (got {type(value).__name__})")
    return value


def _top(entries: list | None, k: int, where: str) -> tuple[list[int], list[float]]:
    """The ``k`` best ``[logprob, token_id, text]`` entries of one position, best first."""
    entries = sorted(entries or [], key=lambda e: -e[0])[:k]
    if len(entries) < k:
        raise Unavailable(f"the SGLang server gave {len(entries)} top logprobs at {where}, {k} were asked")
    return [int(e[1]) for e in entries], [float(e[0]) for e in entries]


def read_sample(plan: Plan, item: Json) -> Sampled:
    """One sample of ``plan`` from its ``/generate`` answer ``item``: tokens and logprobs from
    ``output_token_logprobs``, cut after the first token that ``plan.stop`` stops at."""
    meta = item.get("meta_info") or {}
    out = _entries(meta, "output_token_logprobs")
    tops = meta.get("output_top_logprobs") or [None] * len(out)
    s = Sampled()
    for j, entry in enumerate(out):
        s.tokens.append(int(entry[1]))
        s.logprobs.append(float(entry[0]))
        if plan.topk_sample:
            s.topk.append(_top(tops[j], plan.topk_sample, f"sampled token {j}"))
        if plan.stop.hit(s.tokens):
            s.stop_reason = "stop"
            return s
    finish = (meta.get("finish_reason") or {}).get("type")
    if finish == "abort":
        raise Unavailable(f"the SGLang server aborted the request: {meta['finish_reason'].get('message', '')}")
    s.stop_reason = "length" if finish == "length" or len(s.tokens) >= plan.max_tokens else "stop"
    return s


def read_prompt(plan: Plan, item: Json) -> PromptScores | None:
    """The prompt options of ``plan`` from the first answer ``item`` (None when none was asked). Row ``r`` scores
    prompt token ``r + 1``; SGLang's lists end at the last prompt token, so they are read from the end."""
    ask = plan.ask
    if ask is None or not (ask.logprobs or ask.topk):
        return None
    meta = item.get("meta_info") or {}
    rows = len(plan.prompt) - 1
    logprobs = topk_ids = topk_lps = None
    if ask.logprobs:
        entries = _entries(meta, "input_token_logprobs")[-rows:] if rows else []
        values = [math.nan] * (rows - len(entries)) + [math.nan if e[0] is None else float(e[0]) for e in entries]
        logprobs = torch.tensor(values, dtype=torch.float64)
        logprobs[: ask.scored_from] = math.nan
    if ask.topk:
        tops = _entries(meta, "input_top_logprobs")
        scored = rows - ask.scored_from
        if len(tops) < scored:
            raise Unavailable(f"the SGLang server gave top logprobs for {len(tops)} prompt tokens, {scored} were asked")
        picked = [_top(t, ask.topk, f"prompt token {rows + 1 - scored + j}") for j, t in
                  enumerate(tops[len(tops) - scored:])]
        topk_ids = torch.tensor([ids for ids, _ in picked], dtype=torch.int64).reshape(scored, ask.topk)
        topk_lps = torch.tensor([lps for _, lps in picked], dtype=torch.float64).reshape(scored, ask.topk)
    return PromptScores(logprobs, topk_ids, topk_lps, None, None, None)


def server_error(url: str, call: str, status: int, body: str) -> LatheError:
    """The error of a ``call`` the SGLang server at ``url`` answered with HTTP ``status`` and ``body``: 400 and 422
    are the request's fault (``InvalidArgument``), 404 a missing route or adapter (``NotFound``), the rest the
    server's (``Unavailable``: retry)."""
    text = f"the SGLang server at {url} answered {call} with HTTP {status}: {body.strip()[:500]}"
    if status in (400, 422):
        return InvalidArgument(text)
    if status == 404:
        return NotFound(text)
    return Unavailable(text)
