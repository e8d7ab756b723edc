"""The native sampler engine: continuous batching across requests and adapters, no gRPC in sight.

Data path of a request:
  ``sample(SampleRequest)`` -> admission queue (bounded: ``ResourceExhausted`` when full) -> a loader
  thread resolves the base model, checks the request (``validate.check_sample``) and fetches its
  adapter (``AdapterCache``) -> the waiting line (one FIFO per tenant, ``fair.FairQueue``) -> the
  scheduler thread admits it (tenants in turn, within ``max_running`` sequences, ``max_prefill_tokens``
  per step and ``max_running_tokens`` reserved) -> every step runs, per base model,
  ONE packed forward (``step.run_step``) holding the prompt of each newly admitted request (prefilled
  once, then forked into its ``num_samples`` sequences) and one decode token of every running
  sequence -> each sequence draws its next token from its own last row -> finished sequences
  ("stop": stop token / EOS / stop string; "length": max_tokens) leave the batch at once; when all of
  a request's sequences are done, its future resolves to a ``SampleResult``.

Fairness and budget: tenants take turns at admission, so one tenant's backlog delays another tenant's
request by at most one request per turn. A request reserves ``num_samples x (prompt + max_tokens)``
tokens of the pool's running budget from admission until it finishes; one that asks for more than the
whole budget is refused by ``check_sample`` (it could never run). It also reserves the KV blocks its
sequences can hold at most (``blocks.blocks_needed``) in its base model's ``kv.KVPool`` (``kv_blocks``
blocks): one that does not fit waits, one that never could is refused.

Decode steps (every running sequence one token, no prefill in the step) go through the base model's
``graphs.DecodeRunner`` where it has one: padded to a bucket batch size and replayed from a CUDA graph on
CUDA (``cuda_graphs``), and on the throughput path (``bgmv``: not invariant) with their LoRA through the
adapter slot pool (``slots.SlotPool``, ``adapter_slots`` slots of rank <= ``slot_rank``) by BGMV; a step whose
adapters do not fit the slots at once runs the per-segment path. The invariant mode keeps the
per-segment LoRA ops, whose logprobs equal the trainer's bit for bit.

KV cache: a prefill starts from the cached blocks of the longest prefix of its prompt that an earlier
sequence under the same tenant, base model, adapter and version filled (``prefix_cache``), and feeds only
the rest; its samples share the prompt's full blocks. Finished sequences give their blocks back.

Every problem with one request (bad argument, unknown model, overwritten checkpoint) resolves that
request's future with ``SampleResult(error=...)`` and touches nothing else; only a full queue (and a
stopping engine) is raised from ``sample`` itself, since no request exists yet.

Owns: the base models (one ``Decoder`` per served model, loaded on first use) with their KV pool, slot
pool and decode runner, the KV caches of running sequences, the adapter cache; all of their tensors live
on ``SamplerConfig.device``, while token selection and results stay on the CPU. Never touches the
trainer, storage (bytes come through an ``AdapterSource``) or the network.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from lathe.errors import Internal, InvalidArgument, LatheError, NotFound, ResourceExhausted, Unavailable
from lathe.models.decoder import Decoder, ExpertLoad
from lathe.models.exactness import PoolExactness
from lathe.models.pool import DTYPES, OncePerName, load_decoder
from lathe.sampler.adapters import AdapterCache, AdapterSource, adapter_dtype
from lathe.sampler.blocks import BLOCK
from lathe.sampler.config import Catalog, SamplerConfig
from lathe.sampler.fair import FairQueue
from lathe.sampler.graphs import DecodeRunner, GraphConfig
from lathe.sampler.intake import Ask, capabilities
from lathe.sampler.kv import KVPool
from lathe.sampler.metrics import SamplerMetrics
from lathe.sampler.requests import Request, Seq
from lathe.sampler.slots import SlotPool
from lathe.sampler.step import Item, ItemOut, run_step
from lathe.sampler.validate import ModelLimits, check_sample
from lathe.v1 import lathe_pb2 as pb


@dataclass(slots=True)
class Base:
    model: Decoder
    limits: ModelLimits
    kv: KVPool
    slots: SlotPool | None  # the BGMV path's adapter slots
    runner: DecodeRunner | None  # pure decode steps: padded, CUDA graphs, slots
    kv_reserved: int = 0  # blocks reserved by admitted requests not finished yet


class SamplerEngine:
    def __init__(self, cfg: SamplerConfig, catalog: Catalog, source: AdapterSource | None = None) -> None:
        self.cfg, self.catalog = cfg, catalog
        self.dtype = DTYPES[cfg.dtype]
        self.adapters = AdapterCache(source, cfg.adapter_cache)
        self.steps = 0
        self._bases = OncePerName(self._load, "sampler-load-model")
        self.metrics = SamplerMetrics()
        self.exactness = PoolExactness("sampler", cfg.invariant,
                                       lambda name, exact: self.metrics.exactness.labels(model=name).set(exact))
        self._adapter_dtype = adapter_dtype(self.dtype, cfg.sgmv)
        self._cond = threading.Condition()
        self._live: set[Request] = set()
        self._queued = 0  # accepted and not yet admitted (being checked or waiting)
        self._waiting: FairQueue[Request] = FairQueue(lambda r: r.ask.tenant)
        self._reserved = 0  # tokens reserved by admitted requests not finished yet
        self._running: list[Seq] = []  # the scheduler thread's alone
        self._loader = ThreadPoolExecutor(cfg.loaders, thread_name_prefix="sampler-load")
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- models ----

    def base(self, name: str) -> Base:
        """The served base model ``name`` and what decodes with it, made once (``OncePerName``; ``NotFound`` when
        not served)."""
        return self._bases.get(name)

    def _load(self, name: str) -> Base:
        try:
            entry = self.catalog.resolve(name)
        except KeyError:
            raise NotFound(f"base_model {name!r} is not served by this sampler") from None
        model = load_decoder(entry.path, name, self.exactness.check, dtype=self.cfg.dtype, device=self.cfg.device,
                             invariant=self.cfg.invariant, sgmv=self.cfg.sgmv)
        cfg = model.cfg
        limits = ModelLimits.of(name, cfg, Path(entry.path), entry.max_context_length)
        kv = KVPool.for_model(model, self.cfg.pool_blocks)
        # a sparse layer picks each expert's rows on the host: its steps cannot be captured in a CUDA graph
        bgmv = self.cfg.decode_bgmv
        graphs = self.cfg.cuda_graphs and model.device.type == "cuda" and not cfg.num_experts
        slots = None if bgmv == "off" else SlotPool(model.cfg, self.cfg.adapter_slots, self.cfg.slot_rank,
                                                    model.dtype, model.device, bgmv)
        runner = DecodeRunner(model, kv, slots, GraphConfig(self.cfg.graph_buckets, capture=graphs)) \
            if slots is not None or graphs else None
        return Base(model, limits, kv, slots, runner)

    def warm(self, name: str) -> None:
        """Readiness (``lathe.sampler.engines.Engine``): load and self-check the base model ``name``."""
        self.base(name)

    @property
    def alive(self) -> bool:
        """Whether the scheduler thread runs (False before ``start``, after ``stop`` and once it died)."""
        return self._thread is not None and self._thread.is_alive()

    def capabilities(self) -> pb.ServerCapabilities:
        return capabilities([(e.name, e.max_context_length, self.exactness.fields(e.name))
                             for e in self.catalog.entries()], self.cfg.max_running_tokens)

    def stats(self) -> dict[str, int]:
        """Gauges for monitoring: requests queued (being checked or waiting), of which waiting, running
        sequences, adapters cached, steps run."""
        with self._cond:
            return {"queued": self._queued, "waiting": len(self._waiting), "running": len(self._running),
                    "adapters": len(self.adapters), "steps": self.steps}

    def kv_stats(self) -> dict[str, int]:
        """The KV pools over every base model: blocks free or cached (``available``: evictable), reserved by
        running requests, and the full prompt blocks found cached (``prefix_hits``) or not (``prefix_misses``)."""
        with self._cond:
            bases = self._bases.values()
            return {"available": sum(b.kv.blocks.available for b in bases),
                    "reserved": sum(b.kv_reserved for b in bases),
                    "prefix_hits": sum(b.kv.blocks.hits for b in bases),
                    "prefix_misses": sum(b.kv.blocks.misses for b in bases)}

    # ---- submission ----

    def sample(self, req: pb.SampleRequest) -> Future[pb.SampleResult]:
        """Accept one request; the future resolves to its ``pb.SampleResult`` (output or error).

        Raises ``ResourceExhausted`` (with ``retry_after_s``) when the admission queue is full and
        ``Unavailable`` when the engine is stopping; nothing is queued then.
        """
        with self._cond:
            if self._stopping:
                raise Unavailable("the sampler is shutting down")
            if self._queued >= self.cfg.max_queue:
                raise ResourceExhausted(f"sampler queue is full ({self._queued} requests waiting); retry later",
                                        retry_after_s=1.0)
            self._queued += 1
            r = Request(Ask.of(req), req, Future(), time.monotonic())
            self._live.add(r)
        self._loader.submit(self._prepare, r)
        return r.future

    def _prepare(self, r: Request) -> None:
        """Loader thread: resolve the model, check the request, fetch its adapter, then queue it."""
        try:
            if not r.ask.base_model:
                raise InvalidArgument("base_model is empty: the gateway must name the model to sample")
            r.base = self.base(r.ask.base_model)
            r.plan, r.request = check_sample(r.request, r.base.limits, self.cfg.max_running_tokens), None
            need, usable = r.blocks_needed(), r.base.kv.blocks.usable
            if need > usable:
                raise InvalidArgument(f"num_samples ({r.plan.num_samples}) x (prompt ({len(r.plan.prompt)} tokens) + "
                                      f"max_tokens ({r.plan.max_tokens})) needs {need} KV blocks of {BLOCK} tokens; "
                                      f"this sampler pool has {usable} (--kv-blocks); ask for fewer samples or tokens")
            if r.ask.model_path:
                r.adapter = self.adapters.get(r.ask.tenant, r.ask.model_path, r.ask.model_version,
                                              r.base.model.cfg, self._adapter_dtype, r.ask.base_model,
                                              self.cfg.device)
        except Exception as e:  # noqa: BLE001 - any failure is this request's answer, never a hang
            err = e if isinstance(e, LatheError) else Internal(f"loading failed: {type(e).__name__}: {e}")
            with self._cond:
                self._queued -= 1
            self._finish(r, error=err)
            return
        with self._cond:
            self._waiting.push(r)
            self._cond.notify_all()

    # ---- the scheduler ----

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="sampler-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the scheduler; every request not finished yet gets ``Unavailable``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self._loader.shutdown(wait=True, cancel_futures=True)
        with self._cond:
            live = list(self._live)
        for r in live:
            self._finish(r, error=Unavailable("the sampler shut down before this request finished"))

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._running:
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a bug fails the running requests instead of hanging them
                err = Internal(f"sampler step {self.steps} failed: {type(e).__name__}: {e}")
                for r in {s.request for s in self._running}:
                    self._finish(r, error=err)
                self._running = []

    def _admit(self) -> list[Request]:
        """Take requests off the waiting line, tenants in turn, while they fit (caller holds the lock).

        The first request that does not fit ends the admission, and its tenant keeps its turn: a large
        request waits for room instead of being overtaken for ever."""
        out: list[Request] = []
        seqs, tokens = len(self._running), 0
        while (r := self._waiting.peek()) is not None:
            if not r.future.cancelled():
                n, length, cost = r.plan.num_samples, len(r.plan.prompt), r.plan.reserved_tokens
                blocks = r.blocks_needed()
                if (out or self._running) and (seqs + n > self.cfg.max_running
                                               or tokens + length > self.cfg.max_prefill_tokens
                                               or self._reserved + cost > self.cfg.max_running_tokens):
                    break
                if r.base.kv_reserved + blocks > r.base.kv.blocks.usable:
                    break  # waits for running requests of its base model to give blocks back
                out.append(r)
                seqs, tokens = seqs + n, tokens + length
                r.reserved, r.blocks = cost, blocks
                self._reserved += cost
                r.base.kv_reserved += blocks
            else:
                self._live.discard(r)
            self._waiting.pop()
            self._queued -= 1
        return out

    def step(self) -> int:
        """One step: admit, one packed forward per base model, draw a token per sequence, finish.

        Returns the number of sequences that received a token.
        """
        with self._cond:
            admitted = self._admit()
            cancelled = {s.request for s in self._running if s.request.future.cancelled()}
            self._live -= cancelled
            for r in cancelled:
                self._reserved -= r.reserved
                r.base.kv_reserved -= r.blocks
        for r in cancelled:
            r.release_caches()
        self._running = [s for s in self._running if s.request not in cancelled]
        if not admitted and not self._running:
            return 0
        self.steps += 1
        now = time.monotonic()
        work: dict[int, tuple[Base, list[Request], list[Seq]]] = {}
        for r in admitted:
            r.admitted, r.step = now, self.steps
            work.setdefault(id(r.base), (r.base, [], []))[1].append(r)
        for s in self._running:
            work.setdefault(id(s.request.base), (s.request.base, [], []))[2].append(s)
        advanced: list[Seq] = []
        for base, prefills, decodes in work.values():
            advanced += self._forward(base, prefills, decodes)
        self._running = [s for s in advanced if not s.out.stop_reason]
        self.metrics.record_step(seconds=time.monotonic() - now, sequences=len(advanced), running=len(self._running),
                                 prompt_tokens=sum(len(r.plan.prompt) for r in admitted), reserved=self._reserved,
                                 budget=self.cfg.max_running_tokens, queued=self._queued)
        return len(advanced)

    def _forward(self, base: Base, prefills: list[Request], decodes: list[Seq]) -> list[Seq]:
        """Run one base model's packed forward and draw every sequence's next token."""
        items = []
        for r in prefills:
            cache = r.prompt_cache(base.kv, self.cfg.prefix_cache)
            items.append(Item(list(r.plan.prompt[cache.length:]), cache, r.adapter, r.plan.ask))
        items += [Item([s.out.tokens[-1]], s.cache, s.request.adapter) for s in decodes]
        name = (prefills[0] if prefills else decodes[0].request).ask.base_model
        self.exactness.check_ranks(name, base.model, {i.adapter.spec.rank for i in items if i.adapter is not None})
        try:
            outs = self._run(base, items, decodes if not prefills else None)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: fail these requests, keep serving
            err = Internal(f"sampler step {self.steps} failed: {type(e).__name__}: {e}")
            for item in items[:len(prefills)]:
                item.cache.release()
            for r in {*prefills, *(s.request for s in decodes)}:
                self._finish(r, error=err)
            return []
        advanced: list[Seq] = []
        failed: set[Request] = set()
        k = len(prefills)
        for r, item, out in zip(prefills, items[:k], outs[:k], strict=True):
            try:
                if r.start(item.cache, out):
                    self._finish(r)
                advanced += r.seqs
            except Exception as e:  # noqa: BLE001 - e.g. non-finite logits: fail this request alone
                failed.add(r)
                if not any(s.cache is item.cache for s in r.seqs):
                    item.cache.release()
                self._finish(r, error=Internal(f"sampling failed: {e}"))
        for s, out in zip(decodes, outs[k:], strict=True):
            if s.request in failed:
                continue
            try:
                if s.advance(out):
                    self._finish(s.request)
            except Exception as e:  # noqa: BLE001
                failed.add(s.request)
                self._finish(s.request, error=Internal(f"sampling failed: {e}"))
            advanced.append(s)
        return [s for s in advanced if s.request not in failed]

    def _run(self, base: Base, items: list[Item], decodes: list[Seq] | None) -> list[ItemOut]:
        """The step's forward: a pure decode step (``decodes``: its sequences, in the order of ``items``)
        through the base's ``DecodeRunner`` where it has one, with the step's adapters placed in its slot
        pool; otherwise (prefills, or adapters that do not fit the slots) ``run_step``."""
        if decodes and base.runner is not None:
            idx = None
            if base.slots is not None:
                idx = base.slots.place([None if s.request.adapter is None else (s.request.slot_key(), s.request.adapter)
                                        for s in decodes])
            if base.slots is None or idx is not None:
                return base.runner.run(items, idx)
        load: ExpertLoad = []
        out = run_step(base.model, items, load)
        self.metrics.experts.observe(base.limits.name, load)
        return out

    # ---- results ----

    def _finish(self, r: Request, error: LatheError | None = None) -> None:
        """Resolve ``r``'s future once (with its output, or ``error``) and forget the request."""
        with self._cond:
            if r not in self._live:
                return
            self._live.discard(r)
            self._reserved -= r.reserved
            if r.base is not None:
                r.base.kv_reserved -= r.blocks
        r.release_caches()
        receipt, result = r.result(self.cfg.dtype, self.exactness.stamp(r.ask.base_model), error)
        self.metrics.record_request(queued_s=receipt.queued_s, total_s=receipt.queued_s + receipt.run_s,
                                    failed=error is not None)
        with contextlib.suppress(InvalidStateError):  # the caller may have cancelled it meanwhile
            r.future.set_result(result)
