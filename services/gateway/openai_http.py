"""The OpenAI-compatible door: ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` over ``GatewayCore``.

Any OpenAI client (the ``openai`` package, lm-eval-harness, agent frameworks) calls a tenant's saved adapters by
their sampler checkpoint path (``model="tinker://<run>/sampler_weights/<name>"``) or a served base model by name.
A request is read in OpenAI's schema, turned into one ``SampleRequest`` (a prompt's text encoded and a chat
rendered through the model's own template by ``TextCodecs``), sampled through ``Sampling.sample_now`` (the same
checks, quotas and fair queue as Tinker's ``sample``, no ledger row: the caller waits on its connection) and
answered in OpenAI's shapes: every sampled token's logprob is the sampler's own float, the one ``sample`` returns
for the same prompt and seed. ``stream: true`` answers server-sent events, one chunk per sampled token; the sampler
answers whole samples, so the chunks leave once the sample has finished.

Keys: ``Authorization: Bearer <key>`` (OpenAI's header) or ``X-API-Key``, the same keys and tenants as Tinker's
door. Errors: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with the core error's HTTP status. No
state of its own beyond the codecs.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from lathe.errors import Internal, InvalidArgument, LatheError, NotFound
from lathe.v1 import lathe_pb2 as pb
from lathe.wire import error_from_proto

from .auth import ApiKeys
from .core import GatewayCore
from .json_fields import INT32_MAX, Fields
from .text import Message, TextCodec, TextCodecs

PREFIX = "/v1"
MAX_PROMPTS = 64  # prompts of one /v1/completions call
MAX_LISTED = 1000  # checkpoints /v1/models lists, the newest
MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs (and on a completion's logprobs)
COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def openai_error(err: LatheError, param: str | None = None) -> Response:
    """A core error in OpenAI's error schema (``openai`` raises its ``APIStatusError`` subclass by the status)."""
    headers = {"retry-after": str(max(1, round(err.retry_after_s)))} if err.retry_after_s is not None else None
    body = {"error": {"message": err.message, "type": ERROR_TYPES.get(err.http_status, "server_error"),
                      "param": param, "code": type(err).__name__}}
    return Response(json.dumps(body), err.http_status, headers, media_type="application/json")


@dataclass(frozen=True)
class Ask:
    """One OpenAI call read: the prompts (token ids), what to sample, and how to answer."""

    model: str
    prompts: list[list[int]]
    params: pb.SamplingParams
    n: int
    top_logprobs: int  # the k largest logprobs per sampled token; 0: none
    logprobs: bool  # answer each sampled token's logprob
    stream: bool
    include_usage: bool
    stops: tuple[str, ...]


@dataclass(frozen=True)
class Choice:
    """One sampled sequence as text: its tokens, their pieces of the text, the text cut at a stop string."""

    index: int
    seq: pb.SampledSequence
    pieces: list[str]
    text: str
    finish_reason: str


class OpenAiApi:
    """The ``/v1`` routes over one core; ``app()`` is their ASGI application. ``read_fields`` reads a request's JSON
    body under the gateway's limits (the Tinker door's reader)."""

    def __init__(self, core: GatewayCore, keys: ApiKeys, read_fields: Callable[[Request], Awaitable[Fields]]) -> None:
        self.core, self.keys, self.read_fields = core, keys, read_fields
        self.codecs = TextCodecs(core.sampling.tokenizer_files)

    def app(self) -> Starlette:
        routes = [("GET", "/models", self.models), ("POST", "/completions", self.completions),
                  ("POST", "/chat/completions", self.chat_completions)]
        return Starlette(routes=[Route(path, self.core.metrics.timed("openai" + path.replace("/", "_"),
                                                                     self._endpoint(fn)), methods=[method])
                                 for method, path, fn in routes],
                         exception_handlers={HTTPException: self._no_route})

    async def _no_route(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return openai_error(NotFound(f"{request.method} {request.url.path}: {exc.detail}"))

    def _tenant(self, request: Request) -> str:
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key")
        return self.keys.tinker_tenant(key)

    def _endpoint(self, fn: Callable[[Request, str], Awaitable[Response | dict[str, Any]]]
                  ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                request.state.tenant = tenant = self._tenant(request)
                result = await fn(request, tenant)
            except LatheError as e:
                return openai_error(e)
            except Exception as e:  # noqa: BLE001 - a bug answers 500, never a hang
                return openai_error(Internal(f"internal error in {fn.__name__}: {type(e).__name__}: {e}"))
            return result if isinstance(result, Response) else Response(json.dumps(result),
                                                                        media_type="application/json")

        return endpoint

    # ---- routes ----

    async def models(self, request: Request, tenant: str) -> dict[str, Any]:
        """The served base models and the tenant's sampler checkpoints, newest first."""
        caps = await self.core.lookups.capabilities()
        listed = await self.core.registry.list_checkpoints(tenant, "", MAX_LISTED, 0)
        data = [{"id": m.model_name, "object": "model", "created": 0, "owned_by": "lathe"}
                for m in caps.supported_models]
        data += [{"id": c.tinker_path, "object": "model", "created": int(c.time), "owned_by": tenant}
                 for c in sorted(listed.checkpoints, key=lambda c: -c.time) if c.checkpoint_type == "sampler"]
        return {"object": "list", "data": data}

    async def completions(self, request: Request, tenant: str) -> Response | dict[str, Any]:
        f = await self.read_fields(request)
        model = f.get("model", str)
        base_model, path, version = await self.core.sampling.policy(tenant, model)
        codec = await self.codecs.of(base_model)
        prompts = _prompts(f, codec)
        if f.get("echo", bool, False):
            raise InvalidArgument("echo = true is not supported: ask Tinker's sample for prompt_logprobs instead")
        if f.get("suffix", str, None):
            raise InvalidArgument("suffix is not supported: the served models complete text left to right")
        k = f.get("logprobs", int, None, int_max=INT32_MAX)
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise InvalidArgument(f"logprobs = {k} must be in [0, {MAX_LOGPROBS}]")
        ask = _ask(f, model, prompts, f.get("max_tokens", int, COMPLETION_MAX_TOKENS, int_max=INT32_MAX),
                   logprobs=k is not None, top_logprobs=k or 0)
        choices = await self._sample(tenant, ask, codec, base_model, path, version)
        created, rid = int(time.time()), f"cmpl-{_rid()}"
        usage = _usage(ask, choices)
        if ask.stream:
            chunks = ({"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [{"index": c.index, "text": piece, "finish_reason": fin,
                                    "logprobs": _completion_logprobs(codec, c, i, i + 1) if ask.logprobs else None}]}
                      for c in choices for i, piece, fin in _steps(c))
            return _sse(chunks, {"id": rid, "object": "text_completion", "created": created, "model": model,
                                 "choices": [], "usage": usage} if ask.include_usage else None)
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                             "logprobs": _completion_logprobs(codec, c, 0, len(c.pieces)) if ask.logprobs else None}
                            for c in choices], "usage": usage}

    async def chat_completions(self, request: Request, tenant: str) -> Response | dict[str, Any]:
        f = await self.read_fields(request)
        model = f.get("model", str)
        base_model, path, version = await self.core.sampling.policy(tenant, model)
        codec = await self.codecs.of(base_model)
        messages = _messages(f)
        prompt = codec.encode(codec.render_chat(messages), special=False)
        k = f.get("top_logprobs", int, None, int_max=INT32_MAX)
        logprobs = f.get("logprobs", bool, False)
        if k is not None and not (logprobs and 0 <= k <= MAX_LOGPROBS):
            raise InvalidArgument(f"top_logprobs = {k} must be in [0, {MAX_LOGPROBS}] and needs logprobs = true")
        max_tokens = f.get("max_completion_tokens", int, None, int_max=INT32_MAX)
        ask = _ask(f, model, [prompt], f.get("max_tokens", int, None, int_max=INT32_MAX) if max_tokens is None
                   else max_tokens, logprobs=logprobs, top_logprobs=k or 0)
        choices = await self._sample(tenant, ask, codec, base_model, path, version)
        created, rid = int(time.time()), f"chatcmpl-{_rid()}"
        usage = _usage(ask, choices)
        if ask.stream:
            def chunks() -> Iterator[dict[str, Any]]:
                for c in choices:
                    yield _chat_chunk(rid, created, model, c.index, {"role": "assistant", "content": ""}, None, None)
                    for i, piece, fin in _steps(c):
                        yield _chat_chunk(rid, created, model, c.index, {"content": piece} if piece or not fin else {},
                                          fin, {"content": _chat_logprobs(codec, c, i, i + 1)} if ask.logprobs
                                          else None)
            return _sse(chunks(), {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                   "choices": [], "usage": usage} if ask.include_usage else None)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                             "finish_reason": c.finish_reason,
                             "logprobs": {"content": _chat_logprobs(codec, c, 0, len(c.pieces))}
                             if ask.logprobs else None} for c in choices], "usage": usage}

    # ---- sampling ----

    async def _sample(self, tenant: str, ask: Ask, codec: TextCodec, base_model: str, path: str, version: float
                      ) -> list[Choice]:
        """Every prompt's ``n`` samples as choices, numbered prompt by prompt (OpenAI's order). The prompts are
        sampled at once (the sampler batches them); the text of each choice is decoded off the event loop."""
        results = await asyncio.gather(*(self.core.sampling.sample_now(tenant, pb.SampleRequest(
            prompt=prompt, params=ask.params, num_samples=ask.n, topk_sample_logprobs=ask.top_logprobs,
            base_model=base_model, model_path=path, model_version=version)) for prompt in ask.prompts))
        for res in results:
            if res.WhichOneof("result") == "error":
                raise error_from_proto(res.error)
        seqs = [seq for res in results for seq in res.sample.sequences]
        return await asyncio.to_thread(lambda: [_choice(i, seq, codec, ask.stops) for i, seq in enumerate(seqs)])


def _rid() -> str:
    return uuid.uuid4().hex[:24]


def _prompts(f: Fields, codec: TextCodec) -> list[list[int]]:
    """``prompt`` as token id lists: a string, a list of strings, a list of ids, or a list of id lists."""
    raw = f.get("prompt", object)
    items = raw if isinstance(raw, list) and raw and not all(isinstance(t, int) for t in raw) else [raw]
    if not items or len(items) > MAX_PROMPTS:
        raise InvalidArgument(f"prompt must hold 1 to {MAX_PROMPTS} prompts, got {len(items)}")
    out = []
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            ids = codec.encode(item)
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            ids = item
        else:
            raise InvalidArgument(f"{where} must be a string or a list of token ids")
        if not ids:
            raise InvalidArgument(f"{where} is empty: sampling needs at least one prompt token")
        out.append(ids)
    return out


def _messages(f: Fields) -> list[Message]:
    """``messages``: each an object with a string ``role`` and a ``content`` that is a string or a list of text
    parts (joined)."""
    raw = f.get("messages", list)
    if not raw:
        raise InvalidArgument("messages is empty: a chat needs at least one message")
    out = []
    for i, m in enumerate(raw):
        m = Fields(m, f"messages[{i}]")
        content = m.get("content", object, "")
        if isinstance(content, list):
            parts = [Fields(p, f"messages[{i}].content[{j}]") for j, p in enumerate(content)]
            for j, p in enumerate(parts):
                if p.get("type", str) != "text":
                    raise InvalidArgument(f"messages[{i}].content[{j}].type must be 'text': the served models "
                                          "read text only")
            content = "".join(p.get("text", str) for p in parts)
        elif not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": m.get("role", str), "content": content})
    return out


def _ask(f: Fields, model: str, prompts: list[list[int]], max_tokens: int | None, *, logprobs: bool,
         top_logprobs: int) -> Ask:
    """The sampling fields both routes share, checked in OpenAI's names; ``max_tokens`` as the route reads it
    (None: until an end-of-sequence token or the context's end)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if f.get(name, float, 0.0) != 0.0:
            raise InvalidArgument(f"{name} is not supported (only 0): the sampler draws from the model's own "
                                  "distribution")
    if f.get("logit_bias", dict, {}):
        raise InvalidArgument("logit_bias is not supported: the sampler draws from the model's own distribution")
    n = f.get("n", int, 1, int_max=INT32_MAX)
    if f.get("best_of", int, n, int_max=INT32_MAX) != n:
        raise InvalidArgument("best_of must equal n: the sampler returns every sequence it draws")
    temperature = f.get("temperature", float, 1.0)
    if not 0 <= temperature <= 2:
        raise InvalidArgument(f"temperature = {temperature} must be in [0, 2] (0 is greedy)")
    top_p = f.get("top_p", float, 1.0)
    if not 0 < top_p <= 1:
        raise InvalidArgument(f"top_p = {top_p} must be in (0, 1]")
    if max_tokens is not None and max_tokens < 1:
        raise InvalidArgument(f"max_tokens = {max_tokens} must be >= 1")
    stop = f.get("stop", object, None)
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise InvalidArgument("stop must be a non-empty string or a list of at most 4 of them")
    seed = f.get("seed", int, None)
    params = pb.SamplingParams(temperature=temperature, top_p=top_p, use_eos=True, stop_strings=stops,
                               max_tokens=max_tokens, seed=seed)
    options = f.sub("stream_options", required=False)
    return Ask(model, prompts, params, n, top_logprobs, logprobs, f.get("stream", bool, False),
               options.get("include_usage", bool, False), stops)


def _choice(index: int, seq: pb.SampledSequence, codec: TextCodec, stops: tuple[str, ...]) -> Choice:
    """A sampled sequence as OpenAI's choice: its text ends before the first stop string it holds (the sampler
    stops on the token that completes one), ``finish_reason`` "stop" there or at an end-of-sequence token."""
    pieces = codec.pieces(seq.tokens)
    text = "".join(pieces)
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        text = text[:cut]
    return Choice(index, seq, pieces, text, "stop" if seq.stop_reason == "stop" else "length")


def _steps(c: Choice) -> Iterator[tuple[int, str, str | None]]:
    """(token index, its piece of the choice's text, the finish reason on the last) for a stream; pieces past a
    stop string's start are cut, as the text is."""
    shown = 0
    for i, piece in enumerate(c.pieces):
        piece = piece[:max(0, len(c.text) - shown)]
        shown += len(piece)
        yield i, piece, c.finish_reason if i == len(c.pieces) - 1 else None


def _top(codec: TextCodec, seq: pb.SampledSequence, i: int) -> list[tuple[str, float]]:
    if i >= len(seq.topk_logprobs):
        return []
    top = seq.topk_logprobs[i]
    return [(codec.token_text(t), lp) for t, lp in zip(top.token_ids, top.logprobs, strict=True)]


def _completion_logprobs(codec: TextCodec, c: Choice, start: int, end: int) -> dict[str, Any]:
    """OpenAI's completion logprobs for tokens ``start:end``: each token's text and logprob, the top alternatives
    by text (a later duplicate text keeps the first, higher logprob), and each token's offset in the text."""
    offsets = [sum(len(p) for p in c.pieces[:i]) for i in range(start, end)]
    return {"tokens": [codec.token_text(t) for t in c.seq.tokens[start:end]],
            "token_logprobs": [float(lp) for lp in c.seq.logprobs[start:end]],
            "top_logprobs": [_by_text(_top(codec, c.seq, i)) if c.seq.topk_logprobs else None
                             for i in range(start, end)],
            "text_offset": offsets}


def _by_text(top: list[tuple[str, float]]) -> dict[str, float]:
    """Alternatives keyed by their text, best first; of two tokens with one text, the better one's logprob."""
    out: dict[str, float] = {}
    for text, lp in top:
        out.setdefault(text, float(lp))
    return out


def _chat_logprobs(codec: TextCodec, c: Choice, start: int, end: int) -> list[dict[str, Any]]:
    """OpenAI's chat logprobs content for tokens ``start:end``."""
    out = []
    for i in range(start, end):
        token = codec.token_text(c.seq.tokens[i])
        out.append({"token": token, "logprob": float(c.seq.logprobs[i]), "bytes": list(token.encode()),
                    "top_logprobs": [{"token": t, "logprob": float(lp), "bytes": list(t.encode())}
                                     for t, lp in _top(codec, c.seq, i)]})
    return out


def _usage(ask: Ask, choices: list[Choice]) -> dict[str, int]:
    prompt = sum(len(p) for p in ask.prompts)
    completion = sum(len(c.seq.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chat_chunk(rid: str, created: int, model: str, index: int, delta: dict[str, str], finish: str | None,
                logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}


def _sse(chunks: Iterable[dict[str, Any]], last: dict[str, Any] | None) -> StreamingResponse:
    """Server-sent events: each chunk as a ``data:`` line, then ``last`` (the usage chunk) if any, then ``[DONE]``."""
    async def events() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        if last is not None:
            yield f"data: {json.dumps(last)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
