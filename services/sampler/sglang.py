"""The sglang sampler engine: the pool's samples come from an SGLang server, driven over its HTTP API.

Data path of a request:
  ``sample(SampleRequest)`` -> the engine's event loop (its own thread) -> the base model's limits (its catalog
  directory: config.json, tokenizer.json) -> ``validate.check_sample`` (the native engine's checks) -> its adapter
  published and loaded in the server (``sglang_adapters.ServerAdapters``) -> one ``POST /generate`` holding all its
  samples (``sglang_wire.generate_body``) -> the answers read back (``sglang_wire.read_sample`` / ``read_prompt``)
  -> ``intake.answer``: the same ``SampleResult`` the native engine builds, with a receipt.

Exactness: SGLang computes with its own kernels (even with ``--enable-deterministic-inference``, which makes its
results independent of the batch, not equal to Lathe's), so this engine reports the fingerprint ``"sglang"`` and
``exact = False`` in its capabilities and in every receipt: the gateway's ``logprobs_exact`` is False for its
models, and the SDK warns that sampled logprobs are not the trainer's bit for bit.

Readiness: ``warm`` blocks until the server answers ``GET /health`` and ``GET /get_model_info`` (the pool is not
ready before). Continuous batching, the KV cache and LoRA batching are the server's; this engine bounds only the
requests it holds (``max_queue``). One pool serves the one base model its server serves.

Owns: the event loop thread, the HTTP client, the loaded-adapter list and the published adapter directories
(``sglang_adapter_dir``). Never touches: the model's weights, the trainer, storage (bytes come through the
``AdapterSource``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx

from lathe.errors import Internal, InvalidArgument, LatheError, NotFound, ResourceExhausted, Unavailable
from lathe.models.config import ModelConfig
from lathe.sampler.adapters import AdapterSource
from lathe.sampler.config import Catalog, SamplerConfig
from lathe.sampler.intake import Ask, answer, capabilities, failure
from lathe.sampler.metrics import SamplerMetrics
from lathe.sampler.sglang_adapters import ServerAdapters
from lathe.sampler.sglang_wire import generate_body, read_prompt, read_sample, server_error, unsupported
from lathe.sampler.validate import ModelLimits, Plan, check_sample
from lathe.types import Receipt
from lathe.v1 import lathe_pb2 as pb

FINGERPRINT = "sglang"
"""The fingerprint of every SGLang pool: no trainer prints it, so no SGLang pool is taken for bit-equal."""
NOT_EXACT = ("engine sglang: the SGLang server samples with its own kernels, not Lathe's batch-invariant ops, so its "
             "logprobs are not bit-equal to the trainer's")
WARM_POLL_S = 1.0


class SGLangEngine:
    def __init__(self, cfg: SamplerConfig, catalog: Catalog, source: AdapterSource | None = None) -> None:
        entries = catalog.entries()
        if len(entries) != 1:
            raise ValueError(f"engine 'sglang' serves the one base model of its SGLang server; --models names "
                             f"{[e.name for e in entries]}")
        self.cfg, self.catalog, self.url = cfg, catalog, cfg.sglang_url.rstrip("/")
        self.metrics = SamplerMetrics()
        self.server_info: dict[str, Any] | None = None  # /get_model_info, once the server answered
        self._limits: dict[str, ModelLimits] = {}
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None
        self._live: set[asyncio.Task] = set()  # the loop's own
        self._held = 0  # requests accepted and not answered yet (any thread, under _lock)
        self._lock = threading.Lock()
        self._stopping = False
        self.adapters = ServerAdapters(source, Path(cfg.sglang_adapter_dir), cfg.adapter_cache, self._post,
                                       lambda event: self.metrics.adapter_events.labels(event=event).inc())
        for e in entries:
            self.metrics.exactness.labels(model=e.name).set(0)

    # ---- lifecycle ----

    def start(self) -> None:
        Path(self.cfg.sglang_adapter_dir).mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._loop.run_forever, name="sampler-sglang", daemon=True)
        self._thread.start()
        self._client = self._call(self._open())

    async def _open(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=self.cfg.max_running, max_keepalive_connections=self.cfg.max_running)
        return httpx.AsyncClient(base_url=self.url, limits=limits,
                                 timeout=httpx.Timeout(self.cfg.sglang_timeout_s, connect=10.0))

    def stop(self) -> None:
        """Every unfinished request gets ``Unavailable``; then the loop ends."""
        with self._lock:
            self._stopping = True
        if self._thread is None:
            return
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    async def _close(self) -> None:
        for task in list(self._live):
            task.cancel()
        await asyncio.gather(*self._live, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _call(self, work: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    # ---- the server ----

    async def _post(self, route: str, body: dict) -> Any:
        return await self._request("POST", route, body)

    async def _request(self, method: str, route: str, body: dict | None = None) -> Any:
        """``method route`` on the server, its JSON answer; failures become ``lathe.errors`` naming the server."""
        assert self._client is not None, "start() the engine first"
        try:
            r = await self._client.request(method, route, json=body)
        except httpx.HTTPError as e:
            raise Unavailable(f"the SGLang server at {self.url} did not answer {route}: {type(e).__name__}: {e}") \
                from None
        if r.status_code != 200:
            raise server_error(self.url, route, r.status_code, r.text)
        return r.json() if r.content else None

    def limits(self, name: str) -> ModelLimits:
        """The limits of served base model ``name``, read once (``NotFound`` when not served)."""
        if not name:
            raise InvalidArgument("base_model is empty: the gateway must name the model to sample")
        if name not in self._limits:
            try:
                entry = self.catalog.resolve(name)
            except KeyError:
                raise NotFound(f"base_model {name!r} is not served by this sampler") from None
            directory = Path(entry.path)
            self._limits[name] = ModelLimits.of(name, ModelConfig.from_dir(directory), directory,
                                                entry.max_context_length)
        return self._limits[name]

    def warm(self, name: str) -> None:
        """Block until the server answers ``/health`` and ``/get_model_info`` (the pool's readiness), polling."""
        self.limits(name)
        while self.server_info is None:
            if self._stopping:
                raise Unavailable("the sampler is shutting down")
            try:
                self._call(self._request("GET", "/health"))
                self.server_info = self._call(self._request("GET", "/get_model_info"))
            except Unavailable:
                time.sleep(WARM_POLL_S)

    def capabilities(self) -> pb.ServerCapabilities:
        info = self.server_info
        detail = (f"SGLang server {self.url}, model {info.get('model_path', '?')}" if info is not None else
                  f"SGLang server {self.url} (not answered yet)")
        exactness = {"checked": info is not None, "exact": False, "first_failure": NOT_EXACT,
                     "fingerprint": FINGERPRINT, "detail": detail}
        return capabilities([(e.name, e.max_context_length, exactness) for e in self.catalog.entries()],
                            self.cfg.max_running_tokens)

    # ---- requests ----

    def sample(self, req: pb.SampleRequest) -> Future[pb.SampleResult]:
        """Accept one request (``Engine.sample``); its future resolves once the server answered all its samples."""
        with self._lock:
            if self._stopping or self._thread is None:
                raise Unavailable("the sampler is shutting down")
            if self._held >= self.cfg.max_queue:
                raise ResourceExhausted(f"sampler queue is full ({self._held} requests waiting); retry later",
                                        retry_after_s=1.0)
            self._held += 1
        return asyncio.run_coroutine_threadsafe(self._track(Ask.of(req), req, time.monotonic()), self._loop)

    async def _track(self, ask: Ask, req: pb.SampleRequest, arrived: float) -> pb.SampleResult:
        task = asyncio.current_task()
        self._live.add(task)
        try:
            return await self._answer(ask, req, arrived)
        finally:
            self._live.discard(task)
            with self._lock:
                self._held -= 1

    async def _generate(self, plan: Plan, lora: str | None) -> Any:
        """``POST /generate`` for ``plan``. A refusal of a request with an adapter is retried once after loading the
        adapter again, if the server had lost it (it restarted)."""
        body = generate_body(plan, lora)
        try:
            return await self._post("/generate", body)
        except (InvalidArgument, NotFound, Unavailable):
            if lora is None or not await self.adapters.reload(lora):
                raise
        return await self._post("/generate", body)

    async def _answer(self, ask: Ask, req: pb.SampleRequest, arrived: float) -> pb.SampleResult:
        """One request, start to end: its result, or its error as ``SampleResult.error``."""
        prompt_len, samples, prompt, error = 0, [], None, None
        try:
            limits = await asyncio.to_thread(self.limits, ask.base_model)
            plan = check_sample(req, limits, self.cfg.max_running_tokens)
            unsupported(plan)
            prompt_len = len(plan.prompt)
            lora = await self.adapters.acquire(ask) if ask.model_path else None
            try:
                items = await self._generate(plan, lora)
            finally:
                if lora is not None:
                    await self.adapters.release(lora)
            if not isinstance(items, list) or len(items) != plan.num_samples:
                raise Unavailable(f"the SGLang server at {self.url} answered {plan.num_samples} samples with "
                                  f"{len(items) if isinstance(items, list) else type(items).__name__}")
            samples = [read_sample(plan, item) for item in items]
            prompt = read_prompt(plan, items[0])
        except asyncio.CancelledError:
            if not self._stopping:
                raise  # the caller went away
            error = Unavailable("the sampler shut down before this request finished")
        except LatheError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - any failure is this request's answer, never a hang
            error = Internal(f"sampling through SGLang failed: {type(e).__name__}: {e}")
        now = time.monotonic()
        receipt = Receipt(
            request_id=ask.request_id, model_id="", seq_id=ask.seq_id, cycle=0,
            tokens=prompt_len + sum(len(s.tokens) for s in samples) if error is None else 0, adapter_step=0,
            queued_s=0.0, run_s=now - arrived, dtype="", op="sample", fingerprint=FINGERPRINT, exact=False,
            policy=ask.policy)
        self.metrics.record_request(queued_s=0.0, total_s=now - arrived, failed=error is not None)
        return failure(receipt, error) if error is not None else answer(receipt, ask, prompt_len, prompt, samples)
