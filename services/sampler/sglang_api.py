"""``python -m lathe.sampler.sglang_api``: Lathe's native engine behind the subset of SGLang's HTTP API that the sglang
engine (``lathe.sampler.sglang``) calls, so that engine runs end to end without SGLang (CPU machines, CI).

    GET  /health                ready (200) once the base model is loaded and self-checked, 503 before
    GET  /get_model_info        model_path, tokenizer_path, is_generation, served_model_name; and this server's own
                                extras: loaded_lora_adapters (names), lora_loads, lora_unloads (counts since start)
    POST /load_lora_adapter     {lora_name, lora_path}: reads the PEFT directory at lora_path (checked against the
                                model), serves it as lora_name; a name already loaded is refused (400)
    POST /unload_lora_adapter   {lora_name}: stops serving it (400 when unknown)
    POST /generate              input_ids (one prompt or a batch), sampling_params (one or one per prompt:
                                temperature, top_p, top_k (-1: off), max_new_tokens, stop_token_ids, stop, ignore_eos,
                                sampling_seed), return_logprob, logprob_start_len, top_logprobs_num, lora_path
                                -> per prompt {"text": "", "output_ids", "meta_info": {finish_reason, prompt_tokens,
                                completion_tokens, output_token_logprobs, output_top_logprobs, input_token_logprobs,
                                input_top_logprobs}}, the lists in SGLang's ``[logprob, token_id, text]`` form

Each prompt is one ``SampleRequest`` of one sample to a ``SamplerEngine`` (seed: ``sampling_seed``), so its logprobs
are Lathe's (untempered, as SGLang's with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``). Where the two differ: EOS still ends
a sequence that gives stop tokens or strings under ``ignore_eos`` (Lathe's rule; the sglang engine never asks for
that), and a request's error is ``{"error": {"message"}}`` with the HTTP status of its ``lathe.errors`` type.
Owns: the adapter directory registry (``DirectoryAdapters``) and its engine; serves on loopback or any host it is
given, without authentication (a test double and a local tool, never a public door).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import threading
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lathe.errors import InvalidArgument, LatheError, NotFound
from lathe.models.catalog import ModelCatalog
from lathe.models.pool import add_pool_arguments, apply_threads
from lathe.runtime.options import add_options, options
from lathe.runtime.serving import READY_MARK, http_listener, setup_logging
from lathe.sampler.adapters import CONFIG_FILE, WEIGHTS_FILE, load_adapter
from lathe.sampler.config import SamplerConfig
from lathe.sampler.engine import SamplerEngine
from lathe.v1 import lathe_pb2 as pb
from lathe.wire import error_from_proto

TENANT = "sglang-api"  # the one tenant of every adapter this server loads


class DirectoryAdapters:
    """``AdapterSource`` of the adapters loaded by name: name -> (files, version), a new version at every load."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[dict[str, bytes], float]] = {}
        self._versions = itertools.count(1)
        self.loads = self.unloads = 0
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._files)

    def version(self, name: str) -> float:
        with self._lock:
            if name not in self._files:
                raise NotFound(f"lora_path {name!r} is not a loaded adapter (loaded: {sorted(self._files)})")
            return self._files[name][1]

    def load(self, name: str, files: dict[str, bytes]) -> None:
        with self._lock:
            if name in self._files:
                raise InvalidArgument(f"lora_name {name!r} is already loaded; unload it first")
            self._files[name] = (files, float(next(self._versions)))
            self.loads += 1

    def unload(self, name: str) -> None:
        with self._lock:
            if self._files.pop(name, None) is None:
                raise InvalidArgument(f"lora_name {name!r} is not loaded")
            self.unloads += 1

    def get(self, tenant: str, path: str) -> tuple[dict[str, bytes], float]:
        with self._lock:
            if path not in self._files:
                raise NotFound(f"adapter {path!r} was unloaded")
            return self._files[path]


def _list(value: Any, n: int, field: str) -> list:
    """A per-prompt field of a batch of ``n``: one value for all, or a list of ``n``."""
    if isinstance(value, list):
        if len(value) != n:
            raise InvalidArgument(f"{field} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def sample_request(name: str, prompt: list[int], sp: dict, body: dict, lora: str | None, version: float,
                   index: int) -> pb.SampleRequest:
    """The ``SampleRequest`` of one prompt of a ``/generate`` body."""
    params = pb.SamplingParams(temperature=float(sp.get("temperature", 1.0)), top_p=float(sp.get("top_p", 1.0)),
                               top_k=max(int(sp.get("top_k", -1)), 0), use_eos=not sp.get("ignore_eos", False),
                               stop_token_ids=sp.get("stop_token_ids") or [], stop_strings=_list_of(sp.get("stop")),
                               max_tokens=int(sp.get("max_new_tokens", 128)))
    if sp.get("sampling_seed") is not None:
        params.seed = int(sp["sampling_seed"])
    req = pb.SampleRequest(request_id=f"sglang-api-{index}", tenant=TENANT, base_model=name, prompt=prompt,
                           num_samples=1, params=params, model_path=lora or "", model_version=version)
    if body.get("return_logprob"):
        top = int(body.get("top_logprobs_num") or 0)
        req.topk_sample_logprobs = top
        start = _start(body)
        if 0 <= start < len(prompt) - 1:
            req.prompt_logprobs, req.topk_prompt_logprobs = True, top
            if start > 0:
                req.prompt_logprobs_last_n = len(prompt) - 1 - start
    return req


def _start(body: dict) -> int:
    """``logprob_start_len``: the first prompt position whose logprob is returned (-1, the default: none)."""
    start = body.get("logprob_start_len")
    return -1 if start is None else int(start)


def _list_of(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def _entries(values: list[float], ids: list[int]) -> list[list]:
    return [[None if v != v else v, t, None] for v, t in zip(values, ids, strict=True)]  # NaN (unscored): null


def answer_json(req: pb.SampleRequest, out: pb.SampleOutput, with_logprobs: bool, start: int) -> dict:
    """One prompt's ``/generate`` answer in SGLang's form."""
    seq = out.sequences[0]
    meta: dict[str, Any] = {"id": req.request_id, "finish_reason": {"type": seq.stop_reason},
                            "prompt_tokens": len(req.prompt), "completion_tokens": len(seq.tokens),
                            "cached_tokens": 0}
    if with_logprobs:
        meta["output_token_logprobs"] = _entries(list(seq.logprobs), list(seq.tokens))
        if req.topk_sample_logprobs:
            meta["output_top_logprobs"] = [_entries(list(t.logprobs), list(t.token_ids)) for t in seq.topk_logprobs]
        if req.prompt_logprobs:
            prompt = list(req.prompt)
            meta["input_token_logprobs"] = _entries(list(out.prompt_logprobs)[start:], prompt[start:])
            if req.topk_prompt_logprobs:
                meta["input_top_logprobs"] = [_entries(list(t.logprobs), list(t.token_ids)) or None
                                              for t in list(out.topk_prompt_logprobs)[start:]]
    return {"text": "", "output_ids": list(seq.tokens), "meta_info": meta}


class SGLangApi:
    """The HTTP routes over one ``SamplerEngine`` serving base model ``name``."""

    def __init__(self, engine: SamplerEngine, name: str, adapters: DirectoryAdapters) -> None:
        self.engine, self.name, self.adapters = engine, name, adapters
        self.ready = threading.Event()
        self.app = Starlette(routes=[
            Route("/health", self.health), Route("/get_model_info", self.model_info),
            Route("/load_lora_adapter", self.load, methods=["POST"]),
            Route("/unload_lora_adapter", self.unload, methods=["POST"]),
            Route("/generate", self.generate, methods=["POST"]),
        ], exception_handlers={LatheError: self._error})

    async def _error(self, request: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, LatheError)
        return JSONResponse({"error": {"message": e.message, "code": type(e).__name__}}, status_code=e.http_status)

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.ready.is_set() else 503)

    async def model_info(self, request: Request) -> JSONResponse:
        path = str(self.engine.catalog.resolve(self.name).path)
        return JSONResponse({"model_path": path, "tokenizer_path": path, "is_generation": True,
                             "served_model_name": self.name, "loaded_lora_adapters": self.adapters.names(),
                             "lora_loads": self.adapters.loads, "lora_unloads": self.adapters.unloads})

    @staticmethod
    async def _body(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError as e:
            raise InvalidArgument(f"{request.url.path}: the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise InvalidArgument(f"{request.url.path}: the body must be a JSON object")
        return body

    async def load(self, request: Request) -> JSONResponse:
        body = await self._body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            raise InvalidArgument("load_lora_adapter needs lora_name and lora_path")
        files = await asyncio.to_thread(self._read, Path(path))
        self.adapters.load(name, files)
        return JSONResponse({"success": True, "error_message": "", "loaded_adapters": self.adapters.names()})

    def _read(self, directory: Path) -> dict[str, bytes]:
        """The PEFT files at ``directory``, checked to fit the served model (a bad adapter is refused at load)."""
        files = {f: (directory / f).read_bytes() for f in (WEIGHTS_FILE, CONFIG_FILE) if (directory / f).is_file()}
        load_adapter(files, self.engine.base(self.name).model.cfg, self.engine.dtype, self.name)
        return files

    async def unload(self, request: Request) -> JSONResponse:
        name = (await self._body(request)).get("lora_name")
        self.adapters.unload(name)
        return JSONResponse({"success": True, "error_message": "", "loaded_adapters": self.adapters.names()})

    async def generate(self, request: Request) -> JSONResponse:
        body = await self._body(request)
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            raise InvalidArgument("generate needs input_ids: token ids, or a list of them (text is not served)")
        single = not isinstance(ids[0], list)
        prompts = [ids] if single else ids
        n = len(prompts)
        loras = _list(body.get("lora_path"), n, "lora_path")
        reqs = [sample_request(self.name, prompt, sp or {}, body, lora, self.adapters.version(lora) if lora else 0.0, i)
                for i, (prompt, sp, lora) in enumerate(zip(prompts, _list(body.get("sampling_params"), n,
                                                                          "sampling_params"), loras, strict=True))]
        results = await asyncio.gather(*(asyncio.wrap_future(self.engine.sample(r)) for r in reqs))
        for r in results:
            if r.HasField("error"):
                raise error_from_proto(r.error)
        out = [answer_json(q, r.sample, bool(body.get("return_logprob")), max(_start(body), 0))
               for q, r in zip(reqs, results, strict=True)]
        return JSONResponse(out[0] if single else out)


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(prog="python -m lathe.sampler.sglang_api")
    add_pool_arguments(ap)
    add_options(ap, SamplerConfig)
    args = ap.parse_args()
    apply_threads(args)
    cfg = options(args, SamplerConfig, ap)
    catalog = ModelCatalog.from_spec(cfg.models, cfg.cache_root)
    (name, *more) = catalog.names()
    if more:
        ap.error(f"--models names {[name, *more]}: an SGLang server serves one base model")
    adapters = DirectoryAdapters()
    engine = SamplerEngine(cfg, catalog, adapters)
    api = SGLangApi(engine, name, adapters)
    engine.start()

    def warm() -> None:
        engine.warm(name)
        api.ready.set()

    threading.Thread(target=warm, name="sglang-api-warm", daemon=True).start()
    sock = http_listener(args.host, args.port)
    host, port = sock.getsockname()[:2]
    print(f"lathe.sampler.sglang_api{READY_MARK}{host}:{port}", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(api.app, log_level="warning")).run(sockets=[sock])
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
