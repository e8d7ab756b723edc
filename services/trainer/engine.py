"""The trainer engine: adapter bank + ordered queues + the clock cycle, with no gRPC in sight.

Data path: ``submit(TrainerOp)`` puts an operation into its model's ``Sequencer`` (strict ``seq_id``
order, exactly once) and returns a future. The cycle thread repeatedly takes, for every model, its
next operations in order: at most one forward / forward_backward plus the optim_step right behind it,
or one save / load. Saves and loads run first; then all forward / forward_backward jobs of one base
model run as ONE packed pass (``step.run_jobs``); then the due optim_steps. Each operation gets its own
result and receipt. A failing operation (bad datum, non-finite loss) fails alone and changes nothing;
so does one that trips over a bug: no exception stops the cycle thread. Should the thread end anyway, the
operations still waiting get ``Unavailable`` and so does every later call (``alive`` reports it), so
callers are told instead of waiting forever.

Admission: one tenant's operations may fill at most ``max_queue_per_tenant`` places of the shared queue
(``max_queue``); the operation a run is waiting for is always let in.

Owns: base models (one ``Decoder`` per served base model, loaded on first use), the ``AdapterBank``
(which pages least recently used adapters out when more runs exist than ``max_resident_adapters``),
the sequencers and the cycle metrics. Checkpoint bytes go through ``CheckpointStore`` (the
checkpoints service).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from lathe.checkpoints.store import open_store
from lathe.errors import Internal, InvalidArgument, LatheError, NotFound, ResourceExhausted, Unavailable
from lathe.models.catalog import ModelCatalog
from lathe.models.decoder import Decoder
from lathe.models.exactness import PoolExactness
from lathe.models.lora import LoraSpec, default_seed
from lathe.models.pool import check_device, default_device
from lathe.trainer.bank import Adapter, AdapterBank, read_state
from lathe.trainer.cycle import Partial, Work, plan_cycle
from lathe.trainer.metrics import CycleMetrics
from lathe.trainer.optimizer import AdamParams, adamw_step
from lathe.trainer.order import Pending, Sequencer
from lathe.trainer.step import Job, JobResult, run_jobs
from lathe.trainer.validate import Limits, check_request
from lathe.v1 import lathe_pb2 as pb
from lathe.wire import error_to_proto

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class CheckpointStore(Protocol):
    """What the engine needs from the checkpoints service (see ``lathe.checkpoints.client``)."""

    def put(self, *, tenant: str, run_id: str, kind: str, name: str, files: dict[str, bytes],
            metadata_json: str, ttl_seconds: int, overwrite: bool) -> str: ...

    def get(self, *, tenant: str, path: str) -> dict[str, bytes]: ...


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    models: str = "lathe/tiny-llama"  # catalog spec: comma-separated served names or model dirs
    cache_root: Path = Path(".cache/lathe")
    dtype: str = "float32"  # of the frozen base weights; LoRA weights, gradients and AdamW moments stay fp32
    device: str = field(default_factory=default_device)  # "cuda" or "cpu": base models and the adapter bank
    invariant: bool = True
    sgmv: bool = False  # LoRA through the Triton SGMV kernels (GPU pools; set alike on the sampler pool)
    activation_checkpointing: bool = False  # recompute each layer in backward: ~half the memory, ~20% slower
    max_request_tokens: int = 65536
    cycle_tokens: int = 2048  # token capacity of one clock cycle (CPU default; GPU pools set far more)
    max_queue: int = 4096  # operations waiting, all tenants together
    max_queue_per_tenant: int = 1024  # operations waiting, one tenant's runs together
    max_resident_adapters: int = 256
    cycle_gather_s: float = 0.01  # how long a cycle may wait for an optim_step following a forward_backward
    max_runs_per_cycle: int = 0  # 0: every ready run shares the cycle; 1: one tenant at a time (baseline)
    page_store: str = ""  # where paged-out adapters go ("": <cache_root>/paged)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        check_device(self.device)


@dataclass(slots=True)
class _Model:
    """A training run as the scheduler sees it; its adapter lives in the bank."""

    model_id: str
    tenant: str
    seq: Sequencer = field(default_factory=Sequencer)
    partial: Partial | None = None


def _tensor(arr: np.ndarray) -> pb.Tensor:
    return pb.Tensor(data=arr.tobytes(), dtype=str(arr.dtype), shape=list(arr.shape))


def _fail(item: Pending, err: LatheError) -> None:
    """Answer ``item`` with ``err`` unless it has its answer already (no receipt: it never ran)."""
    if not item.future.done():
        item.future.set_result(pb.TrainerResult(error=error_to_proto(err)))


class TrainerEngine:
    def __init__(self, cfg: TrainerConfig, catalog: ModelCatalog, store: CheckpointStore | None = None) -> None:
        self.cfg = cfg
        self.catalog = catalog
        self.store = store
        self.cycle = 0
        self.metrics = CycleMetrics()
        self.metrics.capacity.set(cfg.cycle_tokens)
        self._bases: dict[str, Decoder] = {}
        self.exactness = PoolExactness("trainer", cfg.invariant)
        self._models: dict[str, _Model] = {}
        pages = open_store(cfg.page_store or cfg.cache_root / "paged")
        self.bank = AdapterBank(cfg.max_resident_adapters, pages, cfg.dtype, lambda name: self.base(name).cfg,
                                cfg.device)
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._loop_died = False  # the cycle thread ended without being stopped
        self._in_cycle: set[str] = set()  # runs of the cycle computing now: their adapters stay resident

    # ---- base models and adapters ----

    def base(self, name: str) -> Decoder:
        if name not in self._bases:
            try:
                entry = self.catalog.resolve(name)
            except KeyError as e:
                raise NotFound(str(e.args[0]) if e.args else f"unknown base model {name!r}") from None
            model = Decoder.from_dir(entry.path, dtype=DTYPES[self.cfg.dtype], device=self.cfg.device,
                                     invariant=self.cfg.invariant, checkpoint_layers=self.cfg.activation_checkpointing)
            model.sgmv = self.cfg.sgmv
            report = self.exactness.check(name, model)
            self.metrics.exactness.labels(model=name).set(float(report.exact))
            self._bases[name] = model
        return self._bases[name]

    @property
    def alive(self) -> bool:
        """False once the cycle thread has ended without ``stop``: the pool is not ready and says so."""
        return not self._loop_died

    def _check_alive(self) -> None:
        if self._loop_died:
            raise Unavailable("this trainer's cycle thread has stopped; the pool is not ready")

    def capabilities(self) -> pb.ServerCapabilities:
        self._check_alive()
        return pb.ServerCapabilities(supported_models=[
            pb.SupportedModel(model_name=e.name, max_context_length=e.max_context_length,
                              trainer_exactness=pb.Exactness(**self.exactness.fields(e.name)))
            for e in self.catalog.entries()
        ])

    def create_adapter(self, req: pb.CreateAdapterRequest) -> pb.AdapterInfo:
        """Create (or, for a repeat of the same request, return) the adapter of a training run."""
        self._check_alive()
        with self._lock:
            if req.model_id in self._models:
                return self._info(self.bank.get(req.model_id))
        if req.from_path:
            adapter = self._adapter_from_state(req)
        else:
            c = req.lora_config
            try:
                spec = LoraSpec(rank=c.rank, alpha=c.alpha if c.HasField("alpha") else 32.0,
                                seed=c.seed if c.HasField("seed") else None, train_attn=c.train_attn,
                                train_mlp=c.train_mlp, train_unembed=c.train_unembed)
            except ValueError as e:
                raise InvalidArgument(f"lora_config: {e}") from None
            model = self.base(req.base_model)
            seed = spec.seed if spec.seed is not None else default_seed(req.model_id)
            adapter = Adapter.fresh(req.model_id, req.tenant, req.base_model, model.cfg, spec, seed, self.cfg.device)
        with self._lock:
            self._models.setdefault(req.model_id, _Model(req.model_id, req.tenant))
            info = self._info(self.bank.add(adapter))
            self._evict(self._pinned())
            return info

    def _adapter_from_state(self, req: pb.CreateAdapterRequest) -> Adapter:
        files = self._store().get(tenant=req.tenant, path=req.from_path)
        state = read_state(files)
        base_model = state["base_model"]
        spec = LoraSpec(**state["lora"])
        adapter = Adapter.fresh(req.model_id, req.tenant, base_model, self.base(base_model).cfg, spec, 0,
                                self.cfg.device)
        adapter.load_files(files, with_optimizer=req.with_optimizer)
        return adapter

    def _info(self, a: Adapter) -> pb.AdapterInfo:
        s = a.spec
        return pb.AdapterInfo(
            model_id=a.model_id, base_model=a.base_model, step=a.step, dtype=self.cfg.dtype,
            lora_config=pb.LoraConfig(rank=s.rank, alpha=s.alpha, train_attn=s.train_attn,
                                      train_mlp=s.train_mlp, train_unembed=s.train_unembed,
                                      **({"seed": s.seed} if s.seed is not None else {})),
        )

    def _store(self) -> CheckpointStore:
        if self.store is None:
            raise InvalidArgument("this trainer has no checkpoint store configured")
        return self.store

    # ---- submission ----

    def submit(self, op: pb.TrainerOp) -> Future:
        """Queue one ordered operation; the future resolves to a ``pb.TrainerResult``."""
        self._check_alive()
        with self._lock:
            m = self._models.get(op.model_id)
            if m is None or m.tenant != op.tenant:
                raise NotFound(f"unknown model_id {op.model_id!r}")
            # the operation a run is waiting for is always let in (refusing it could block the run for good),
            # and so is a repeat, which takes no new place
            if op.seq_id != m.seq.next_seq and op.seq_id not in m.seq.waiting:
                self._admit(op.tenant)
            fut, new = m.seq.offer(op.seq_id, op, time.monotonic())
            if new:
                self._lock.notify_all()
            return fut

    def _admit(self, tenant: str) -> None:
        """Refuse one more waiting operation of ``tenant`` when its share or the whole queue is full."""
        queued = mine = 0
        for x in self._models.values():
            queued += len(x.seq)
            mine += len(x.seq) if x.tenant == tenant else 0
        if mine >= self.cfg.max_queue_per_tenant:
            raise ResourceExhausted(f"this tenant has {mine} operations waiting in the trainer queue, its limit "
                                    f"of {self.cfg.max_queue_per_tenant}; wait for results before sending more",
                                    retry_after_s=1.0)
        if queued >= self.cfg.max_queue:
            raise ResourceExhausted(f"trainer queue is full ({queued} operations waiting); retry later",
                                    retry_after_s=1.0)

    # ---- the cycle ----

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="trainer-cycle", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stopping and not self._ready():
                        self._lock.wait()
                    deadline = time.monotonic() + self.cfg.cycle_gather_s
                    while not self._stopping and self._awaiting_step() and time.monotonic() < deadline:
                        self._lock.wait(timeout=deadline - time.monotonic())
                    if self._stopping:
                        return
                try:
                    self.run_cycle()
                except Exception:  # noqa: BLE001 - run_cycle answers its operations itself; the loop goes on
                    traceback.print_exc(file=sys.stderr)
        finally:
            self._after_loop()

    def _after_loop(self) -> None:
        """The cycle thread is ending. Unless it was stopped, mark the pool not ready and answer every
        operation still waiting with ``Unavailable``: nobody waits forever on a thread that is gone."""
        with self._lock:
            if self._stopping:
                return
            self._loop_died = True
            items = [m.partial.item for m in self._models.values() if m.partial is not None]
            for m in self._models.values():
                m.partial = None
                items += m.seq.waiting.values()
                m.seq.waiting.clear()
        err = Unavailable("this trainer's cycle thread stopped before running this operation; retry on a "
                          "healthy pool")
        for item in items:
            _fail(item, err)

    def _awaiting_step(self) -> bool:
        """Is a forward_backward at the head of a queue whose next operation has not arrived yet?

        A client sends a forward_backward and its optim_step back to back; waiting a few milliseconds
        for the step lets both land in the same cycle instead of two.
        """
        for m in self._models.values():
            head = m.seq.peek()
            if (head is not None and head.op.WhichOneof("op") == "forward_backward"
                    and not head.op.forward_backward.forward_only and m.seq.next_seq + 1 not in m.seq.waiting):
                return True
        return False

    def _ready(self) -> bool:
        return any(m.partial is not None or m.seq.peek() is not None for m in self._models.values())

    def _begin(self, m: _Model, item: Pending) -> Partial | None:
        """Check a forward / forward_backward request as it reaches the head of its run's queue.

        Whatever goes wrong here (a bad request, or a bug) answers this request alone."""
        req = item.op.forward_backward
        try:
            model = self.base(self.bank.base_model(m.model_id))
            limits = Limits(model.cfg.vocab_size, model.cfg.max_position_embeddings, self.cfg.max_request_tokens)
            examples, loss_cfg = check_request(req.data, req.loss_fn, dict(req.loss_fn_config), limits)
            partial = Partial(item, examples, req.loss_fn, loss_cfg, backward=not req.forward_only)
            if partial.backward and partial.tokens > self.cfg.cycle_tokens:
                partial.grad_backup = {n: None if p.grad is None else p.grad.clone()
                                       for n, p in self.bank.get(m.model_id).weights.named_parameters().items()}
        except Exception as e:  # noqa: BLE001 - one request's failure, never the cycle thread's
            err = e if isinstance(e, LatheError) else Internal(
                f"checking seq_id {item.seq_id} failed: {type(e).__name__}: {e}")
            self._finish(m, item, self.cycle + 1, time.monotonic(), pb.TrainerResult(error=error_to_proto(err)))
            return None
        m.partial = partial
        return partial

    def run_cycle(self) -> int:
        """Run one cycle over whatever is ready; returns the number of runs it touched."""
        t0 = time.monotonic()
        with self._lock:
            runs = list(self._models.values())
            if runs:
                k = self.cycle % len(runs)
                runs = runs[k:] + runs[:k]
            works = plan_cycle([(m, m.seq, m.partial) for m in runs], self.cfg.cycle_tokens, self._begin,
                               self.cfg.max_runs_per_cycle)
            if not works:
                return 0
            self.cycle += 1
            cycle = self.cycle
            queued = sum(len(m.seq) for m in self._models.values())
            self._in_cycle = {w.run.model_id for w in works}
        start = time.monotonic()
        self.metrics.planning_seconds.observe(start - t0)
        tokens = 0
        try:
            for w in works:
                if w.control is not None:
                    self._finish(w.run, w.control, cycle, start, self._control(w.run, w.control.op))
            tokens = self._compute([w for w in works if w.compute is not None], cycle, start)
            for w in works:
                if w.optim is not None:
                    self._finish(w.run, w.optim, cycle, start, self._optim(w.run, w.optim.op.optim_step))
        except Exception as e:  # noqa: BLE001 - a bug fails this cycle's unanswered operations, not the thread
            self._fail_cycle(works, Internal(f"cycle {cycle} failed: {type(e).__name__}: {e}"))
        finally:
            with self._lock:
                self._in_cycle = set()
                self._evict(self._pinned())
        m = self.metrics
        m.cycles.inc()
        m.cycle_seconds.observe(time.monotonic() - start)
        m.tokens.inc(tokens)
        m.utilization.set(tokens / self.cfg.cycle_tokens)
        m.adapters_in_cycle.set(len(works))
        m.queue_depth.set(queued)
        return len(works)

    def _fail_cycle(self, works: list[Work], err: LatheError) -> None:
        """Answer every operation of ``works`` not answered yet with ``err``; their runs drop their
        request in progress (restoring the gradients it had added to, when they were saved)."""
        for w in works:
            if w.compute is not None and not w.compute.item.future.done():
                if w.compute.grad_backup is not None:
                    for n, param in self.bank.get(w.run.model_id).weights.named_parameters().items():
                        param.grad = w.compute.grad_backup[n]
                w.run.partial = None
            for item in (w.control, w.compute.item if w.compute is not None else None, w.optim):
                if item is not None:
                    _fail(item, err)

    def _pinned(self) -> set[str]:
        """Runs whose adapters must stay resident: the cycle computing now, and requests in progress."""
        return self._in_cycle | {m.model_id for m in self._models.values() if m.partial is not None}

    def _evict(self, pinned: set[str]) -> None:
        self.bank.evict(pinned)
        self.metrics.resident_adapters.set(self.bank.resident)
        self.metrics.paged_adapters.set(self.bank.paged)

    def _finish(self, m: _Model, item: Pending, cycle: int, start: float, result: pb.TrainerResult,
                tokens: int = 0) -> None:
        exactness = self.exactness.fields(self.bank.base_model(m.model_id))
        result.receipt.CopyFrom(pb.Receipt(
            request_id=item.op.request_id, model_id=item.op.model_id, seq_id=item.seq_id, cycle=cycle,
            tokens=tokens, adapter_step=self.bank.get(m.model_id).step, queued_s=start - item.arrived,
            run_s=time.monotonic() - start, dtype=self.cfg.dtype, op=item.op.WhichOneof("op"),
            fingerprint=str(exactness.get("fingerprint", "")), exact=bool(exactness.get("exact", False)),
        ))
        self.metrics.wait_seconds.observe(max(0.0, start - item.arrived))
        item.future.set_result(result)

    def _compute(self, works: list[Work], cycle: int, start: float) -> int:
        """One packed pass per base model over this cycle's forward / forward_backward parts."""
        by_base: dict[str, list[Work]] = {}
        for w in works:
            by_base.setdefault(self.bank.base_model(w.run.model_id), []).append(w)
        tokens = 0
        for base, group in by_base.items():
            jobs = [Job(self.bank.get(w.run.model_id).weights, w.compute.examples[w.part[0]:w.part[1]],
                        w.compute.loss_fn, w.compute.loss_cfg, w.compute.backward) for w in group]
            tokens += sum(len(x) for j in jobs for x in j.examples)
            try:
                results = run_jobs(self.base(base), jobs)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: fail these requests, keep serving
                results = [JobResult(error=Internal(f"cycle {cycle} failed: {type(e).__name__}: {e}"))
                           for _ in jobs]
            for w, res in zip(group, results, strict=True):
                self._absorb(w, res, cycle, start)
        return tokens

    def _absorb(self, w: Work, res: JobResult, cycle: int, start: float) -> None:
        """Fold one part's result into its request; answer the request when it is done or failed."""
        m, p = w.run, w.compute
        if res.error is None:
            p.logprobs += res.logprobs
            p.loss += res.loss
            p.done = w.part[1]
            if not w.last_part:
                return
        elif p.grad_backup is not None:
            for n, param in self.bank.get(m.model_id).weights.named_parameters().items():
                param.grad = p.grad_backup[n]
        m.partial = None
        out = self._fb_result(p, res.error)
        self._finish(m, p.item, cycle, start, out, tokens=p.tokens)
        if res.error is not None and w.optim is not None:
            self._finish(m, w.optim, cycle, start, self._optim(m, w.optim.op.optim_step))
            w.optim = None

    @staticmethod
    def _fb_result(p: Partial, error: LatheError | None) -> pb.TrainerResult:
        if error is not None:
            return pb.TrainerResult(error=error_to_proto(error))
        outputs = [pb.LossFnOutput(tensors={"logprobs": _tensor(lp.numpy().astype(np.float32))})
                   for lp in p.logprobs]
        return pb.TrainerResult(forward_backward=pb.ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics={"loss:sum": p.loss}))

    def _optim(self, m: _Model, req: pb.OptimStepRequest) -> pb.TrainerResult:
        a = req.adam_params
        try:
            hp = AdamParams(a.learning_rate, a.beta1, a.beta2, a.eps, a.weight_decay, a.grad_clip_norm).check()
        except LatheError as e:
            return pb.TrainerResult(error=error_to_proto(e))
        try:
            adapter = self.bank.get(m.model_id)
            metrics = adamw_step(adapter.weights.named_parameters(), adapter.opt, hp)
        except Exception as e:  # noqa: BLE001 - this step fails alone
            return pb.TrainerResult(error=error_to_proto(Internal(f"optim_step failed: {type(e).__name__}: {e}")))
        return pb.TrainerResult(optim_step=pb.OptimStepOutput(metrics=metrics))

    def _control(self, m: _Model, op: pb.TrainerOp) -> pb.TrainerResult:
        try:
            adapter = self.bank.get(m.model_id)
            if op.WhichOneof("op") == "save":
                req = op.save
                if req.kind not in ("weights", "sampler_weights"):
                    raise InvalidArgument(f"save kind {req.kind!r} must be 'weights' or 'sampler_weights'")
                files = adapter.state_files(self.cfg.dtype) if req.kind == "weights" else adapter.sampler_files()
                meta = {"base_model": adapter.base_model, "step": adapter.step, **adapter.peft_config(),
                        "user_metadata": dict(req.user_metadata)}
                path = self._store().put(tenant=op.tenant, run_id=adapter.model_id, kind=req.kind, name=req.name,
                                         files=files, metadata_json=json.dumps(meta),
                                         ttl_seconds=req.ttl_seconds, overwrite=req.overwrite)
                return pb.TrainerResult(save=pb.SaveOutput(path=path))
            req = op.load
            files = self._store().get(tenant=op.tenant, path=req.path)
            adapter.load_files(files, with_optimizer=req.with_optimizer)
            return pb.TrainerResult(load=pb.LoadOutput(path=req.path, model_id=adapter.model_id))
        except LatheError as e:
            return pb.TrainerResult(error=error_to_proto(e))
        except Exception as e:  # noqa: BLE001 - e.g. a checkpoint the store cannot decode: this operation fails alone
            return pb.TrainerResult(error=error_to_proto(Internal(f"{op.WhichOneof('op')} failed: "
                                                                  f"{type(e).__name__}: {e}")))
