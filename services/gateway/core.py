"""The gateway core, shared by both front doors (gRPC ``lathe.v1.Gateway`` and the Tinker HTTP API).

Owns: sessions, the training-run registry (model id -> tenant, base model, LoRA config, metadata,
last checkpoints), sampling sessions (id -> pinned policy version), futures (request id -> result) and
the idempotency map ``(model_id, seq_id) -> request id``. Routes model operations and samples to the trainer
and sampler of the pool serving their base model (``routing.PoolRouter`` over a ``discovery.PoolDirectory``)
and checkpoint queries to the checkpoints service. It holds no model state and
imports no torch; per-model ``seq_id`` ordering is enforced where operations are applied, in the
trainer's sequencer, so a repeat or an early arrival is safe on every path.

Every request is checked at the door before anything is registered (``limits``, ``quotas``): a refused one
leaves no state behind, and a submit that fails on its way in (admission or transport) is not remembered as the
result of its ``seq_id``, so its retry runs. A full trainer queue is met at the door (``backpressure``): new training
operations of the tenant for that pool are refused (429, retry after) while one already accepted waits for a place.
The idempotency map forgets a ``seq_id`` together with its finished future, so it stays as bounded as the futures
are.

Durable (``store.ControlStore``, written through before each answer): sessions, runs, sampling sessions and
the ledger of operations. An operation is recorded (its request included) before its request id is answered,
and its result before its future resolves; ``restore`` loads all of it when the gateway starts and sends the
operations still pending to the trainer or sampler again (the trainer answers a repeat of a ``seq_id`` with
its first result). In memory only: the waiters and recent results (``futures``), capabilities.

Replicas: several gateways may share one database. Lookups read through to it (``_find_*``), the database
numbers a session's runs and sampling clients and names the request that holds a ``(model_id, seq_id)``, and a
future another replica produces is read from the ledger (``_recorded_result``).

A trainer that restarted has lost its runs: the first operation that finds its run gone rebuilds it there from
the run's recovery snapshot and the logged operations after it (``_rebuild``; ``lathe.trainer.recovery``).

Ids are Tinker's: runs are ``"{session}:train:{n}"`` and sampling sessions ``"{session}:sample:{n}"``,
where ``n`` is the client's own counter when it sends one (Tinker's SDK computes ids from it) and the
session's next number otherwise; a repeated creation answers the first one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any

from lathe.backoff import Backoff
from lathe.errors import (
    Cancelled,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    LatheError,
    NotFound,
    PermissionDenied,
)
from lathe.internal_auth import internal_aio_channel
from lathe.serving import CHANNEL_OPTIONS
from lathe.types import (
    CHECKPOINT_TYPES,
    EPHEMERAL_TTL_S,
    MAX_TTL_S,
    OPTIMIZERS,
    RECOVERY_KIND,
    check_no_project,
    recovery_path,
)
from lathe.v1 import checkpoints_pb2 as cpb
from lathe.v1 import checkpoints_pb2_grpc as cpb_grpc
from lathe.v1 import lathe_pb2 as pb
from lathe.wire import error_from_proto, error_to_proto

from .backpressure import TrainerBackpressure
from .calls import RECONNECT_OPTIONS, Caller, CallPolicy
from .completions import Completion, CompletionQueues, queue_key
from .copies import copy_checkpoint, copy_run_id
from .discovery import PoolDirectory, StaticDirectory
from .downloads import EXPORT_NOTE_KEY
from .futures import KEEP_DONE_BYTES, Entry, FutureStore
from .limits import DoorLimits, check_op
from .metrics import GatewayMetrics
from .quotas import Charge, Quotas, adapter_bytes, lora_of_checkpoint
from .records import Operation, Run, SamplingSession, Session
from .routing import PoolRouter
from .session_search import SessionQuery, search
from .sessions import SESSION_IDLE_S, SessionBook
from .store import ControlStore

log = logging.getLogger("lathe.gateway")

MAX_WAIT_S = 30.0  # a long-poll is held at most this long
FOREIGN_POLL_FIRST_S = 0.05  # the ledger is read for a result another gateway is producing this soon, then
FOREIGN_POLL_S = 0.5  # at most this far apart
REBUILD_ATTEMPTS = 3  # an operation finding its run gone from the trainer rebuilds it at most this often
CAPABILITIES_TTL_S = 30.0
PURGE_EVERY_S = 60.0  # how often finished operations past the retention are deleted from the ledger


def _not_reserved(path: str, action: str) -> None:
    """Refuse a tenant's ``action`` on a trainer's recovery snapshot (``tinker://<run>/recovery/latest``): that kind
    is reserved to the trainer, which alone writes it and sets its expiry; a copy would be a checkpoint that no
    listing shows and no byte quota counts, and a deletion or a new TTL would lose the run's recovery. Read from
    the path alone, before any lookup, so the answer is the same whoever owns the run."""
    parts = path.removeprefix("tinker://").split("/")
    if len(parts) == 3 and parts[1] == RECOVERY_KIND:
        raise PermissionDenied(f"checkpoint {path!r} is a recovery snapshot: kind {RECOVERY_KIND!r} is reserved to "
                               f"the trainer, and its checkpoints cannot be {action}")


def _replayed(run: Run, seq_id: int, rec: Operation | None) -> pb.TrainerOp:
    """What a rebuild sends again for ``seq_id`` of ``run``: its recorded request, or a skip for a seq_id refused at
    the door (no record) and for an answered save (it changed no state of the run, its answer stands, and saving
    again would bring back a checkpoint the user may have deleted since)."""
    if rec is not None and not (rec.kind == "save" and rec.state == "done"):
        return pb.TrainerOp.FromString(rec.request)
    reason = "refused at the door" if rec is None else "an answered save: not saved again"
    return pb.TrainerOp(model_id=run.model_id, seq_id=seq_id, tenant=run.tenant, skip=pb.SkipRequest(reason=reason))


class GatewayCore:
    def __init__(self, trainer_target: str, checkpoints_target: str, sampler_target: str,
                 limits: DoorLimits | None = None, quotas: Quotas | None = None, store: ControlStore | None = None,
                 calls: CallPolicy | None = None, pools: PoolDirectory | None = None,
                 metrics: GatewayMetrics | None = None, keep_result_bytes: int = KEEP_DONE_BYTES,
                 session_idle_s: float = SESSION_IDLE_S, clock: Callable[[], float] = time.time) -> None:
        """``store``: the control plane's database (default: SQLite in memory, gone with the process).
        ``pools``: where each base model's trainer and sampler are (``discovery``; default: one fixed pool at
        ``trainer_target`` and ``sampler_target``). ``metrics``: where usage is counted (``metrics``).
        ``keep_result_bytes``: the bytes of finished results kept in memory (``futures``). ``session_idle_s``: how
        long a session may go unheard (no heartbeat, no request naming it) before it is finished; ``clock`` reads
        the time for that."""
        self.metrics = metrics or GatewayMetrics()
        self.limits = limits or DoorLimits()
        self.quotas = quotas or Quotas()
        self.backpressure = TrainerBackpressure()
        self.store = store or ControlStore()
        self.caller = Caller(calls)
        self.router = PoolRouter(pools or StaticDirectory(trainer_target, sampler_target), self.caller)
        self._channel = internal_aio_channel(checkpoints_target, [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS])  # + secret
        self.checkpoints = cpb_grpc.CheckpointsStub(self._channel)
        self.futures = FutureStore(keep_done=self.store.cfg.keep_done, keep_bytes=keep_result_bytes,
                                   on_drop=self._forget)
        self.completions = CompletionQueues()
        self.book = SessionBook(self.store, self.quotas, session_idle_s, clock)
        self.runs: dict[str, Run] = {}
        self._by_seq: dict[tuple[str, int], str] = {}  # (model or sampling session id, seq_id) -> request
        self._caps: tuple[float, int, pb.ServerCapabilities] | None = None  # (when, router generation, caps)
        self._lora_costs: dict[str, pb.LoraCost] = {}  # base model -> its trainer's LoRA cost, as last reported
        self._tasks: set[asyncio.Task] = set()
        self._next_purge = 0.0

    async def close(self) -> None:
        await self.router.close()
        await self._channel.close()

    # ---- plumbing ----

    async def _call(self, rpc, request, *, work: bool = False, idempotent: bool = True):  # noqa: ANN001, ANN202
        """One internal call (any unary aio stub method) with its deadline (``work``: a model operation, adapter
        creation or sample, which may queue), retried while its service is unavailable when ``idempotent``."""
        policy = self.caller.policy
        return await self.caller.call(rpc, request, deadline_s=policy.work_s if work else policy.quick_s,
                                      idempotent=idempotent)

    def _spawn(self, entry: Entry, work) -> None:  # noqa: ANN001 - a coroutine producing a FutureResult
        async def runner() -> None:
            try:
                result = await work
            except LatheError as e:
                result = pb.FutureResult(error=error_to_proto(e))
            except Exception as e:  # noqa: BLE001 - any crash becomes the request's error, never a hang
                result = pb.FutureResult(error=pb.Error(code="Internal", message=f"internal error: {e}",
                                                        category="server"))
            self._finish(entry, result)

        entry.task = self._background(runner())

    def _background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Run ``work`` as a task the core holds until it ends."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _finish(self, entry: Entry, result: pb.FutureResult) -> None:
        """Record ``result`` in the ledger, then resolve the future (its key goes if the submit failed on its way
        in); every ``PURGE_EVERY_S`` the ledger drops what is past its retention."""
        result.request_id, result.done = entry.request_id, True
        entry.task = None
        now = time.time()
        try:
            self.store.finish_op(entry.request_id, result, now, release_key=entry.seq_key is None)
            if now >= self._next_purge:
                self._next_purge = now + PURGE_EVERY_S
                self.store.purge(now)
        except Exception as e:  # noqa: BLE001 - the waiters still get the result; only its record is missing
            log.error("recording the result of %s failed: %s: %s", entry.request_id, type(e).__name__, e)
        self.futures.complete(entry, result)
        self.completions.done(entry.request_id, failed=result.HasField("error"))
        self.metrics.finished(entry.tenant, result)

    def _record(self, entry: Entry, op: Operation, run: Run | None = None) -> str:
        """Write ``op`` to the ledger; the request id holding its key: ``entry``'s, or (the key was taken, e.g.
        by a request made before a restart) the first one's, and then ``entry`` is dropped."""
        try:
            holder = self.store.add_op(op, run)
        except BaseException:
            self.futures.discard(entry)
            raise
        if holder != entry.request_id:
            self.futures.discard(entry)
        return holder

    def _forget(self, entry: Entry) -> None:
        """Drop the idempotency key of ``entry`` if it still names it (its result is gone, or never came)."""
        if entry.seq_key is not None and self._by_seq.get(entry.seq_key) == entry.request_id:
            del self._by_seq[entry.seq_key]

    def _remember(self, entry: Entry, key: tuple[str, int],
                  work: Awaitable[pb.FutureResult]) -> Awaitable[pb.FutureResult]:
        """Map ``key`` to ``entry`` while ``work`` runs; a submission that fails (a ``LatheError`` raised on
        the way in: admission, transport, a run that could not be created) forgets it, so a retry runs."""
        entry.seq_key = key
        self._by_seq[key] = entry.request_id

        async def attempt() -> pb.FutureResult:
            try:
                return await work
            except LatheError:
                self._forget(entry)
                entry.seq_key = None  # the ledger releases it with the result
                raise

        return attempt()

    # ---- lookups: memory first, then the database (another gateway over it may have made the record) ----

    def _find_run(self, model_id: str) -> Run | None:
        """The run, adopted from the database if another gateway created it: ready at once if its creation
        finished, else once the ledger says it did (``_await_creation``)."""
        run = self.runs.get(model_id)
        if run is None and (run := self.store.get_run(model_id)) is not None:
            self.runs[model_id] = run
            created = self.store.get_op(run.create_request_id)
            if created is None or created.result is not None:
                run.ready.set()
            else:
                self._background(self._await_creation(run))
        return run

    async def _await_creation(self, run: Run) -> None:
        """Set ``run.ready`` once the gateway creating it records the outcome (its error, if it failed)."""
        result = await self._recorded_result(run.create_request_id, math.inf)
        if result is not None and result.HasField("error"):
            run.error = error_from_proto(result.error)
            self.runs.pop(run.model_id, None)
        run.ready.set()

    async def _recorded_result(self, request_id: str, timeout_s: float) -> pb.FutureResult | None:
        """The ledger's result of ``request_id`` (an operation another gateway runs), polled until it is there
        or ``timeout_s`` has passed (None: still pending)."""
        backoff = Backoff(FOREIGN_POLL_FIRST_S, FOREIGN_POLL_S, timeout_s)
        while True:
            op = self.store.get_op(request_id)
            if op is None or op.result is not None:
                return None if op is None else pb.FutureResult.FromString(op.result)
            if (pause := backoff.next()) is None:
                return None
            await asyncio.sleep(pause)

    def find_run(self, tenant: str, model_id: str) -> Run | None:
        """The tenant's run ``model_id``, or None (as ``run`` without the error)."""
        r = self._find_run(model_id)
        return r if r is not None and r.tenant == tenant else None

    def run(self, tenant: str, model_id: str) -> Run:
        r = self.find_run(tenant, model_id)
        if r is None:
            raise NotFound(f"unknown model_id {model_id!r}")
        return r

    # ---- sessions (``SessionBook``'s) and capabilities ----

    def session(self, tenant: str, session_id: str) -> Session:
        return self.book.get(tenant, session_id)

    def heartbeat(self, tenant: str, session_id: str) -> None:
        self.book.heartbeat(tenant, session_id)

    def create_session(self, tenant: str, user_metadata: dict[str, str], display_name: str | None = None) -> str:
        return self.book.create(tenant, user_metadata, display_name)

    def finish_session(self, tenant: str, session_id: str, reason: str) -> None:
        self.book.finish(tenant, session_id, reason)

    async def capabilities(self) -> pb.ServerCapabilities:
        """The models of the pools present, each with its trainer's and sampler's exactness joined (cached while
        every model is checked and no pool came or went: ``routing.PoolRouter``)."""
        now, generation = time.monotonic(), self.router.generation
        if self._caps is None or now - self._caps[0] > CAPABILITIES_TTL_S or self._caps[1] != generation:
            caps = await self.router.capabilities()
            sample_budget = caps.limits.max_sample_tokens  # the sampler pools' budget
            caps.limits.CopyFrom(self.limits.proto())
            caps.limits.max_sample_tokens = sample_budget
            settled = all(m.trainer_exactness.checked and m.sampler_exactness.checked for m in caps.supported_models)
            self._caps = (now if settled else -math.inf, generation, caps)
            self._lora_costs |= {m.model_name: m.lora_cost for m in caps.supported_models if m.HasField("lora_cost")}
        return self._caps[2]

    async def _context_length(self, base_model: str) -> int:
        """The context length of ``base_model`` as the capabilities say; 0 while no pool serves it."""
        caps = await self.capabilities()
        return next((m.max_context_length for m in caps.supported_models if m.model_name == base_model), 0)

    async def _check_base_model(self, base_model: str) -> int:
        context = await self._context_length(base_model)
        if not context:
            names = [m.model_name for m in (await self.capabilities()).supported_models]
            raise InvalidArgument(f"unknown base_model {base_model!r}; this server serves {names}")
        return context

    async def checkpoint(self, tenant: str, path: str) -> cpb.CheckpointInfo:
        """The caller's checkpoint at ``path`` (the checkpoints service refuses anyone else's)."""
        return await self._call(self.checkpoints.Stat, cpb.CheckpointRef(tenant=tenant, path=path))

    # ---- training runs ----

    def _start_run(self, tenant: str, session_id: str, model_seq_id: int | None, adapter: pb.CreateAdapterRequest,
                   user_metadata: dict[str, str], lora: pb.LoraConfig | None = None) -> pb.SubmitResponse:
        """Register run ``"{session_id}:train:{n}"`` and create its adapter in the background.

        ``n`` is the client's ``model_seq_id`` (Tinker's SDK computes model ids from it), else the session's
        next number. A repeat of a ``model_seq_id`` answers the first request again; nothing is created twice.
        ``lora``: the run's LoRA config when it is not the request's (a saved state's). Synchronous, so that
        concurrent repeats cannot both get past the check."""
        s = self.book.open(tenant, session_id)
        if model_seq_id is not None:
            if model_seq_id < 0:
                raise InvalidArgument(f"model_seq_id must be >= 0, got {model_seq_id}")
            known = self._find_run(f"{session_id}:train:{model_seq_id}")
            if known is not None:
                return pb.SubmitResponse(request_id=known.create_request_id, model_id=known.model_id)
        lora = adapter.lora_config if lora is None else lora
        costs = self._lora_costs
        held = [adapter_bytes(costs.get(base), config, optimizer)
                for base, config, optimizer in self.store.run_configs(tenant)]
        self.quotas.admit_run(tenant, held, adapter_bytes(costs.get(adapter.base_model), lora,
                                                          adapter.optimizer or OPTIMIZERS[0]),
                              self.futures.pending(tenant), user_metadata)
        n = self.store.number(session_id, "next_model", model_seq_id)  # the database numbers, for every gateway
        s.next_model = max(s.next_model, n + 1)
        model_id = f"{session_id}:train:{n}"
        entry = self.futures.create(tenant)
        run = Run(model_id, tenant, session_id, adapter.base_model, lora, dict(user_metadata),
                  create_request_id=entry.request_id, optimizer=adapter.optimizer or OPTIMIZERS[0])
        adapter.model_id, adapter.tenant = model_id, tenant
        adapter.max_resident_adapters = self.quotas.of(tenant).max_resident_adapters
        create = Operation(entry.request_id, tenant, model_id, None, "create_model", adapter.SerializeToString())
        try:
            holder = self.store.put_run(run, create)
        except BaseException:
            self.futures.discard(entry)
            raise
        if holder != entry.request_id:  # another gateway over this database created it first
            self.futures.discard(entry)
            return pb.SubmitResponse(request_id=holder, model_id=model_id)
        self.runs[model_id] = run
        self._spawn(entry, self._create_adapter(run, adapter))
        return pb.SubmitResponse(request_id=entry.request_id, model_id=model_id)

    async def create_model(self, tenant: str, req: pb.CreateModelRequest, model_seq_id: int | None = None
                           ) -> pb.SubmitResponse:
        await self._check_base_model(req.base_model)
        if not 1 <= req.lora_config.rank <= 256:
            raise InvalidArgument(f"lora_config.rank = {req.lora_config.rank} is outside [1, 256]")
        if req.optimizer not in ("", *OPTIMIZERS):
            raise InvalidArgument(f"optimizer = {req.optimizer!r}: Lathe trains with {' or '.join(OPTIMIZERS)}")
        return self._start_run(tenant, req.session_id, model_seq_id, pb.CreateAdapterRequest(
            base_model=req.base_model, lora_config=req.lora_config, optimizer=req.optimizer), dict(req.user_metadata))

    async def create_model_from_state(self, tenant: str, req: pb.CreateModelFromStateRequest,
                                      model_seq_id: int | None = None, base_model: str = "") -> pb.SubmitResponse:
        """A run starting from a saved training state. ``base_model``, when given, must be the state's."""
        info = await self.checkpoint(tenant, req.path)
        if info.kind != "weights":
            raise InvalidArgument(f"path {req.path!r} is a {info.kind} checkpoint; a training client starts "
                                  "from a training state (tinker://<run>/weights/<name>)")
        meta = json.loads(info.metadata_json or "{}")
        saved_base = meta.get("base_model", "")
        if base_model and base_model != saved_base:
            raise InvalidArgument(f"base_model {base_model!r} is not the base model {saved_base!r} of {req.path!r}")
        with contextlib.suppress(LatheError):  # no pool answering: the creation itself fails, and says why
            await self.capabilities()  # the LoRA costs the adapter-bytes quota reads
        return self._start_run(tenant, req.session_id, model_seq_id, pb.CreateAdapterRequest(
            base_model=saved_base, from_path=req.path, with_optimizer=req.with_optimizer, optimizer=req.optimizer),
            dict(req.user_metadata), lora_of_checkpoint(meta))

    async def _create_adapter(self, run: Run, req: pb.CreateAdapterRequest) -> pb.FutureResult:
        """Create the run's adapter. Whatever happens, ``run.ready`` is set: whoever waits on the run (its
        info, its operations) then gets the adapter or the error, never an endless wait."""
        try:
            info = await self._call(self.router.trainer(run.base_model, run.model_id).CreateAdapter, req, work=True)
            run.base_model, run.lora = info.base_model, info.lora_config
            run.optimizer = info.optimizer or run.optimizer  # a state loaded with its optimizer brings its family
            self.store.update_run(run)
        except LatheError as e:
            run.error = e
            self._drop_run(run)
            raise
        except Exception as e:  # recorded for the waiters, then the request's own error
            run.error = Internal(f"creating the adapter failed: {type(e).__name__}: {e}")
            self._drop_run(run)
            raise
        finally:
            run.ready.set()
        return pb.FutureResult(create_model=pb.CreateModelOutput(model_id=run.model_id))

    def _drop_run(self, run: Run) -> None:
        self.runs.pop(run.model_id, None)
        self.store.delete_run(run.model_id)

    async def get_info(self, tenant: str, model_id: str) -> pb.ModelInfo:
        run = self.run(tenant, model_id)
        await run.wait_ready()
        ctx = await self._check_base_model(run.base_model)
        return pb.ModelInfo(model_id=model_id, base_model=run.base_model, lora_config=run.lora,
                            tokenizer_id=run.base_model, max_context_length=ctx, optimizer=run.optimizer)

    # ---- ordered model operations ----

    async def submit(self, tenant: str, model_id: str, seq_id: int, **op: object) -> pb.SubmitResponse:
        """Submit one ordered operation (exactly one of forward_backward / optim_step / save / load)."""
        return self._submit(tenant, model_id, seq_id, op, self._run_op)

    def _submit(self, tenant: str, model_id: str, seq_id: int, op: dict[str, object],
                work: Callable[[Run, pb.TrainerOp], Awaitable[pb.FutureResult]], sampling_seq_id: int | None = None
                ) -> pb.SubmitResponse:
        """Register ``(model_id, seq_id)`` once and run ``work`` for it; a repeat gets the first request id.
        ``sampling_seq_id``: the sampling session ``work`` binds (recorded, so a restart can do it again)."""
        run = self.run(tenant, model_id)
        if seq_id < 1:
            raise InvalidArgument(f"seq_id must be >= 1, got {seq_id}")
        known = self._by_seq.get((model_id, seq_id))
        if known is not None:
            return pb.SubmitResponse(request_id=known, model_id=model_id)
        with self.refusing(tenant, model_id, seq_id):
            check_op(op)
        self.quotas.admit_op(tenant, self.futures.pending(tenant), op)
        self.backpressure.admit(run.base_model, tenant, model_id, seq_id)
        entry = self.futures.create(tenant)
        run.last_request_time = time.time()
        trainer_op = pb.TrainerOp(model_id=model_id, seq_id=seq_id, request_id=entry.request_id, tenant=tenant,
                                  max_checkpoint_bytes=self.quotas.of(tenant).max_checkpoint_bytes, **op)
        holder = self._record(entry, Operation(entry.request_id, tenant, model_id, seq_id, next(iter(op)),
                                               trainer_op.SerializeToString(), sampling_seq_id), run)
        if holder == entry.request_id:
            self._spawn(entry, self._remember(entry, (model_id, seq_id), work(run, trainer_op)))
        return pb.SubmitResponse(request_id=holder, model_id=model_id)

    @contextlib.contextmanager
    def refusing(self, tenant: str, model_id: str, seq_id: int) -> Iterator[None]:
        """Around the checks of an ordered operation before it is submitted (a door decoding its body, ``_submit``
        checking its parameters): a client error raised there, which a retry would meet again, passes over its
        ``seq_id`` on the trainer (``_skip``), since the client moves on to the next one. Only for the tenant's own
        run and a ``seq_id`` not already taken; admission and transport errors are not client errors of this kind
        (the client retries them under the same ``seq_id``)."""
        try:
            yield
        except (InvalidArgument, NotFound, FailedPrecondition) as e:
            run = self.find_run(tenant, model_id)
            if run is not None and seq_id >= 1 and (model_id, seq_id) not in self._by_seq:
                self._skip(run, seq_id, e)
            raise

    def _skip(self, run: Run, seq_id: int, refused: LatheError) -> None:
        """Tell the trainer that ``seq_id`` was refused here, so the run's later seq_ids need not wait for it.
        Best effort: should it not get through, they fail after the trainer's ``order_wait_s`` instead."""
        async def send() -> None:
            try:
                await run.wait_ready()
                skip = pb.TrainerOp(model_id=run.model_id, seq_id=seq_id, tenant=run.tenant,
                                    skip=pb.SkipRequest(reason=refused.message))
                await self._call(self.router.trainer(run.base_model, run.model_id).Run, skip)
            except LatheError:
                pass

        self._background(send())

    async def _run_op(self, run: Run, op: pb.TrainerOp) -> pb.FutureResult:
        await run.wait_ready()
        res = await self._apply(run, op)
        if res.receipt.recovery_path and res.receipt.recovery_seq_id > run.recovery_seq:
            run.recovery_seq = res.receipt.recovery_seq_id  # the ledger may now let go of what came before
            self.store.update_run(run)
        out = pb.FutureResult(receipt=res.receipt)
        kind = res.WhichOneof("result")
        getattr(out, kind).CopyFrom(getattr(res, kind))
        if kind == "save":
            if op.save.kind == "weights":
                run.last_checkpoint, run.last_checkpoint_time = res.save.path, time.time()
            elif EXPORT_NOTE_KEY not in op.save.user_metadata:  # an export's staging snapshot is not the run's
                run.last_sampler_checkpoint, run.last_sampler_checkpoint_time = res.save.path, time.time()
            self.store.update_run(run)
        return out

    async def _apply(self, run: Run, op: pb.TrainerOp) -> pb.TrainerResult:
        """``Trainer.Run(op)``, offered again while the trainer's queue is full (``backpressure``); should the
        trainer not know the run (it restarted and lost it), rebuild the run there first and send ``op`` again."""
        trainer = self.router.trainer(run.base_model, run.model_id)
        for attempt in range(REBUILD_ATTEMPTS):
            seen = run.rebuilds
            try:
                return await self.backpressure.send(run.base_model, run.tenant, run.model_id, op.seq_id,
                                                    lambda: self._call(trainer.Run, op, work=True))
            except NotFound:
                if attempt == REBUILD_ATTEMPTS - 1:
                    raise
                await self._rebuild(run, seen)
        raise AssertionError("unreachable")

    async def _rebuild(self, run: Run, seen: int) -> None:
        """Recreate ``run`` on a trainer that lost it, from its recovery snapshot (a fresh run never snapshotted is
        made fresh again), then apply again, in order, every recorded operation from the ``seq_id`` the trainer now
        expects up to the last one answered; a ``seq_id`` refused at the door (no record) and an answered save are
        skipped (``_replayed``; a load is never replayed unless its snapshot failed: the trainer snapshots every
        load). The replayed results are dropped (the recorded ones stand); operations still pending are sent on by
        their own requests, and one the snapshot covers is answered from its record (``lathe.trainer.recovery``).
        A missing snapshot fails the rebuild, and so the operation, with the trainer's ``FailedPrecondition`` naming
        the run; so does a replayed operation that fails where it once succeeded (a load whose checkpoint is gone),
        naming the run and the operation: a run that silently skipped it would not be the run its answers describe.
        ``seen``: ``run.rebuilds`` when the caller found the run gone: if another request (or gateway: the trainer
        answers a live run as it is) rebuilt it since, nothing is done again."""
        async with run.rebuilding:
            if run.rebuilds != seen:
                return
            t0 = time.monotonic()
            trainer = self.router.trainer(run.base_model, run.model_id)
            info: pb.AdapterInfo = await self._call(trainer.CreateAdapter, pb.CreateAdapterRequest(
                model_id=run.model_id, tenant=run.tenant, base_model=run.base_model, lora_config=run.lora,
                optimizer=run.optimizer, recover_from=recovery_path(run.model_id),
                max_resident_adapters=self.quotas.of(run.tenant).max_resident_adapters), work=True)
            logged = self.store.replay(run.model_id, info.next_seq_id)
            answered = max((op.seq_id for op in logged if op.state == "done"), default=info.next_seq_id - 1)
            recorded = {op.seq_id: op for op in logged if op.seq_id <= answered}
            ops = {seq_id: _replayed(run, seq_id, recorded.get(seq_id)) for seq_id in range(info.next_seq_id,
                                                                                            answered + 1)}
            results = await asyncio.gather(*(self._call(trainer.Run, op, work=True) for op in ops.values()))
            for (seq_id, op), res in zip(ops.items(), results, strict=True):
                rec = recorded.get(seq_id)
                if res.HasField("error") and not op.HasField("skip") and rec is not None and rec.state == "done" \
                        and not pb.FutureResult.FromString(rec.result).HasField("error"):
                    raise FailedPrecondition(
                        f"run {run.model_id!r} cannot be rebuilt as it was: replaying its {rec.kind} of seq_id "
                        f"{seq_id}, which succeeded, failed now ({res.error.code}: {res.error.message})")
            run.rebuilds += 1
            log.info("rebuilt %s on the trainer from seq_id %d (step %d): %d operations replayed in %.1f s",
                     run.model_id, info.next_seq_id, info.step, len(ops), time.monotonic() - t0)

    def save_for_sampling(self, tenant: str, model_id: str, seq_id: int, sampling_seq_id: int) -> pb.SubmitResponse:
        """Save the adapter as ephemeral sampler weights and bind sampling session
        ``"{session}:sample:{sampling_seq_id}"`` to them once saved; the result names that session
        (``SaveOutput.sampling_session_id``). A repeat gets the same request."""
        if (model_id, seq_id) not in self._by_seq:  # refused before the save, not after it
            self.book.admit_sampling(tenant, self.run(tenant, model_id).session_id, sampling_seq_id)
        save = pb.SaveRequest(model_id=model_id, seq_id=seq_id, name=f"ephemeral-s{seq_id}", kind="sampler_weights",
                              ttl_seconds=EPHEMERAL_TTL_S)
        work = functools.partial(self._save_then_bind, sampling_seq_id=sampling_seq_id)
        return self._submit(tenant, model_id, seq_id, {"save": save}, work, sampling_seq_id)

    async def _save_then_bind(self, run: Run, op: pb.TrainerOp, sampling_seq_id: int) -> pb.FutureResult:
        out = await self._run_op(run, op)
        if out.HasField("save"):
            bound = await self.create_sampling_session(run.tenant, pb.CreateSamplingSessionRequest(
                session_id=run.session_id, model_path=out.save.path), seq_id=sampling_seq_id)
            out.save.sampling_session_id = bound.sampling_session_id  # in the result: recorded with it
        return out

    def _request(self, tenant: str, request_id: str) -> Entry | Operation:
        """The tenant's request: its future here, or else its ledger record (finished, or running at another
        gateway over this database); NotFound for anyone else's."""
        try:
            return self.futures.get(request_id, tenant)
        except NotFound:
            op = self.store.get_op(request_id)
            if op is None or op.tenant != tenant:
                raise
            return op

    def answered(self, tenant: str, result: pb.FutureResult) -> str:
        """The id of a request of ``tenant`` answered at once with ``result`` (nothing to run; the Tinker SDK reads
        every answer through a future). Kept in memory only, as a finished future."""
        entry = self.futures.create(tenant)
        self.futures.complete(entry, result)
        return entry.request_id

    async def retrieve(self, tenant: str, request_id: str, timeout_s: float) -> pb.FutureResult:
        """The result (held up to ``timeout_s`` while pending); one no longer in memory comes from the ledger. A
        ``done=False`` answer carries the tenant's ``queue_state`` as it is then (a fresh message each time)."""
        found = self._request(tenant, request_id)
        if isinstance(found, Entry):
            res = await self.futures.wait(found, min(timeout_s, MAX_WAIT_S))
        elif found.result is None:  # pending at another gateway over this database: held while it runs there
            recorded = await self._recorded_result(request_id, min(timeout_s, MAX_WAIT_S))
            res = recorded or pb.FutureResult(request_id=request_id, done=False)
        else:
            return pb.FutureResult.FromString(found.result)
        if not res.done:
            state, reason = self.queue_state(tenant)
            res.queue_state, res.queue_state_reason = state, reason or ""
        return res

    def cancel(self, tenant: str, request_id: str) -> bool:
        """Cancel a sample not finished yet: its future answers ``Cancelled`` at once and its call to the sampler
        is cancelled, which drops it from the sampler's queue or, running, takes its sequences out of the batch
        (the tokens generated so far are not returned). False when the request had already finished (its
        result stays). Training operations are refused: a run's later ``seq_id``s wait for each one."""
        entry = self._request(tenant, request_id)
        if isinstance(entry, Operation):
            if entry.result is not None:
                return False
            raise FailedPrecondition(f"request_id {request_id!r} is running at another gateway over this "
                                     "database; it can be cancelled only there")
        if entry.result is not None:
            return False
        op = self.store.get_op(request_id)
        if op is None or op.kind != "sample":
            kind = op.kind if op is not None else "unknown"
            raise FailedPrecondition(f"request_id {request_id!r} is a {kind} operation; only samples can be "
                                     "cancelled (a training run applies its operations in seq_id order)")
        if entry.task is not None:
            entry.task.cancel()
        self._finish(entry, pb.FutureResult(error=error_to_proto(Cancelled(f"request_id {request_id!r} was "
                                                                             "cancelled by the client"))))
        return True

    async def completed_samples(self, tenant: str, sampling_session_id: str, client: int, prev_cursor: int,
                                timeout_s: float) -> tuple[list[Completion], int]:
        """The samples of one client of the tenant's sampling session finished since ``prev_cursor`` (held up to
        ``timeout_s`` while none are), and the cursor to pass next (``completions.CompletionQueues``)."""
        self.sampling_session(tenant, sampling_session_id)
        if client < 0 or prev_cursor < 0:
            raise InvalidArgument(f"cloned_sampler_id = {client} and prev_cursor = {prev_cursor} must be >= 0")
        return await self.completions.wait((sampling_session_id, client), prev_cursor, min(timeout_s, MAX_WAIT_S))

    def join_sampling_session(self, tenant: str, sampling_session_id: str) -> int:
        return self.book.join_sampling(tenant, sampling_session_id)

    def queue_state(self, tenant: str) -> tuple[str, str | None]:
        """Why the tenant's requests wait, as Tinker's ``queue_state`` and a reason: ``paused_capacity`` while a
        trainer queue is full for it (``backpressure``), ``paused_rate_limit`` while one of its own quotas
        (requests in flight, tokens per minute) refuses new work, else ``active``."""
        full = self.backpressure.paused(tenant)
        if full is not None:
            return "paused_capacity", full
        reason = self.quotas.pressure(tenant, self.futures.pending(tenant))
        return ("active", None) if reason is None else ("paused_rate_limit", reason)

    # ---- listings ----

    def list_sessions(self, tenant: str, limit: int, offset: int) -> list[str]:
        """A page of the tenant's session ids, newest first."""
        if limit < 1 or offset < 0:
            raise InvalidArgument(f"limit and offset must be >= 1 and >= 0, got limit={limit} offset={offset}")
        return self.store.list_sessions(tenant, limit, offset)

    async def search_sessions(self, tenant: str, query: SessionQuery
                              ) -> tuple[list[tuple[Session, list[cpb.CheckpointInfo]]], Session | None]:
        """A page of the tenant's sessions matching ``query`` (``session_search``), each with the live checkpoints
        of its runs, and the last one shown when more match; the cursor's session must be one of the tenant's."""
        start = None
        if query.after is not None:
            s = self.book.find(query.after)
            if s is None or s.tenant != tenant:
                raise NotFound(f"cursor.last_session_id {query.after!r} is not one of your sessions")
            start = (s.created_at, s.session_id)
        found, last = search(query, functools.partial(self.store.sessions_after, tenant), start)
        by_session: dict[str, list[cpb.CheckpointInfo]] = {}
        for c in await self.tenant_checkpoints(tenant) if found else ():
            by_session.setdefault(c.run_id.rpartition(":train:")[0], []).append(c)
        return [(s, by_session.get(s.session_id, [])) for s in found], last

    async def tenant_checkpoints(self, tenant: str) -> list[cpb.CheckpointInfo]:
        """Every live checkpoint of the tenant, with its size (the checkpoints service's listing)."""
        res = await self._call(self.checkpoints.List, cpb.ListCheckpointsRequest(tenant=tenant))
        return list(res.checkpoints)

    async def storage_usage(self, tenant: str, project_id: str | None) -> tuple[int, int]:
        """How many live checkpoints the tenant has and their bytes, now (``project_id`` refused: no projects)."""
        check_no_project("project_id", project_id)
        checkpoints = await self.tenant_checkpoints(tenant)
        return len(checkpoints), sum(c.size_bytes for c in checkpoints)

    async def weights_info(self, tenant: str, path: str) -> pb.WeightsInfo:
        """The tenant's checkpoint's weights: base model and rank from its metadata, plus the LoRA module flags and
        the optimizer family while its run is in the registry (unset otherwise)."""
        info = await self.checkpoint(tenant, path)
        meta = json.loads(info.metadata_json or "{}")
        out = pb.WeightsInfo(base_model=meta.get("base_model", ""), is_lora=True, lora_rank=meta.get("r"))
        run = self.find_run(tenant, info.run_id)
        if run is not None:
            out.train_mlp, out.train_attn = run.lora.train_mlp, run.lora.train_attn
            out.train_unembed, out.optimizer = run.lora.train_unembed, run.optimizer
        return out

    def session_members(self, tenant: str, session_id: str) -> tuple[Session, list[str], list[str]]:
        """The tenant's session, its training run ids and its sampling session ids."""
        return self.book.mine(tenant, session_id), *self.store.session_members(session_id)


    def list_runs(self, tenant: str, limit: int, offset: int, project_id: str | None = None
                  ) -> tuple[list[Run], int]:
        """A page of the tenant's training runs, oldest first (``limit`` 0: 20), and how many there are
        (``project_id`` refused: no projects)."""
        check_no_project("project_id", project_id)
        if limit < 0 or offset < 0:
            raise InvalidArgument(f"limit and offset must be >= 0, got limit={limit} offset={offset}")
        mine = sorted((r for r in self.runs.values() if r.tenant == tenant), key=lambda r: r.created_at)
        return mine[offset:offset + (limit or 20)], len(mine)

    async def list_checkpoints(self, tenant: str, run_id: str, limit: int, offset: int
                               ) -> pb.ListRunCheckpointsResponse:
        if run_id:
            self.run(tenant, run_id)
        res = await self._call(self.checkpoints.List, cpb.ListCheckpointsRequest(
            tenant=tenant, run_id=run_id, limit=limit, offset=offset))
        return pb.ListRunCheckpointsResponse(total_count=res.total_count, checkpoints=[
            pb.CheckpointEntry(checkpoint_id=f"{c.kind}/{c.name}",
                               checkpoint_type=CHECKPOINT_TYPES[c.kind],
                               tinker_path=c.path, time=c.created_at, size_bytes=c.size_bytes,
                               expires_at=c.expires_at, public=c.public,
                               user_metadata=json.loads(c.metadata_json or "{}").get("user_metadata", {}))
            for c in res.checkpoints
        ])

    async def delete_checkpoint(self, tenant: str, path: str) -> None:
        _not_reserved(path, "deleted")
        await self._call(self.checkpoints.Delete, cpb.CheckpointRef(tenant=tenant, path=path), idempotent=False)

    async def copy_checkpoint(self, tenant: str, source: str, ttl_seconds: int | None, idempotency_key: str | None,
                              session_id: str | None = None, model_seq_id: int | None = None) -> str:
        """Copy the tenant's checkpoint at ``source`` (``copies``) and return the copy's path; it expires after
        ``ttl_seconds`` (None: never). It goes under run ``"{session_id}:train:{model_seq_id}"`` (a slot no run
        holds) when the session is given, else under a run id of its own derived from ``idempotency_key``; no run
        is registered (the copy cannot be trained on)."""
        _not_reserved(source, "copied")
        if ttl_seconds is not None and not 1 <= ttl_seconds <= MAX_TTL_S:
            raise InvalidArgument(f"ttl_seconds = {ttl_seconds} must be in [1, {MAX_TTL_S}], or null for no expiry")
        if session_id is None:
            run_id = copy_run_id(tenant, idempotency_key)
        else:
            self.book.open(tenant, session_id)
            if model_seq_id is None or model_seq_id < 0:
                raise InvalidArgument(f"model_seq_id = {model_seq_id} must be >= 0 with session_id")
            run_id = f"{session_id}:train:{model_seq_id}"
            if self._find_run(run_id) is not None:
                raise InvalidArgument(f"model_seq_id {model_seq_id} of session {session_id!r} holds training run "
                                      f"{run_id!r}; copy into a slot of its own")
            self.store.number(session_id, "next_model", model_seq_id)  # no later run takes the slot
        info = await copy_checkpoint(self.checkpoints, tenant, source, run_id, ttl_seconds or 0,
                                     self.quotas.of(tenant).max_checkpoint_bytes)
        return info.path

    async def set_checkpoint_ttl(self, tenant: str, path: str, ttl_seconds: int | None) -> None:
        """The caller's checkpoint at ``path`` expires ``ttl_seconds`` from now (None: never)."""
        _not_reserved(path, "given another TTL")
        if ttl_seconds is not None and not 0 < ttl_seconds <= MAX_TTL_S:
            raise InvalidArgument(f"ttl_seconds = {ttl_seconds} must be in [1, {MAX_TTL_S}], or null to remove the "
                                  "expiration")
        await self._call(self.checkpoints.SetTtl, cpb.SetTtlRequest(tenant=tenant, path=path,
                                                                   ttl_seconds=ttl_seconds or 0))

    async def set_checkpoint_public(self, tenant: str, path: str, public: bool) -> None:
        _not_reserved(path, "published")
        await self._call(self.checkpoints.SetPublic, cpb.SetPublicRequest(tenant=tenant, path=path, public=public),
                         idempotent=False)

    # ---- sampling ----

    async def create_sampling_session(self, tenant: str, req: pb.CreateSamplingSessionRequest,
                                      seq_id: int | None = None) -> pb.SamplingSession:
        """Bind a sampling client to one policy version: the checkpoint at ``model_path`` as it is now
        (its creation time pins it), or the base model. The id is ``"{session}:sample:{n}"``, ``n`` being the
        client's ``seq_id`` (a repeat returns the session already made) or else the session's next number."""
        self.book.open(tenant, req.session_id)
        if req.model_path:
            info = await self.checkpoint(tenant, req.model_path)
            base_model = json.loads(info.metadata_json or "{}").get("base_model", "")
            version = info.created_at
        elif req.base_model:
            await self._check_base_model(req.base_model)
            base_model, version = req.base_model, 0.0
        else:
            raise InvalidArgument("a sampling client needs model_path or base_model")
        return self.book.bind_sampling(tenant, req.session_id, seq_id, base_model, req.model_path, version).proto()

    def sampling_session(self, tenant: str, sampling_session_id: str) -> SamplingSession:
        return self.book.sampling_session(tenant, sampling_session_id)

    async def sample(self, tenant: str, req: pb.SampleRequest) -> pb.SubmitResponse:
        """Submit a sample; the tokens it may sample are charged now (``quotas.admit_sample``: without max_tokens,
        what the model's context leaves after the prompt) and what it did not sample is given back once it ends."""
        rec = self.sampling_session(tenant, req.sampling_session_id)
        context = 0 if req.params.HasField("max_tokens") else await self._context_length(rec.base_model)
        key = (rec.sampling_session_id, req.seq_id)
        if req.seq_id and key in self._by_seq:
            return pb.SubmitResponse(request_id=self._by_seq[key])
        self.limits.check_sample(req)
        charge = self.quotas.admit_sample(tenant, self.futures.pending(tenant), req, context)
        entry = self.futures.create(tenant)
        full = pb.SampleRequest()
        full.CopyFrom(req)
        full.tenant, full.base_model, full.model_path = tenant, rec.base_model, rec.model_path
        full.model_version, full.request_id = rec.version, entry.request_id
        holder = self._record(entry, Operation(entry.request_id, tenant, rec.sampling_session_id, req.seq_id or None,
                                               "sample", full.SerializeToString()))
        if holder == entry.request_id:
            self.completions.watch(entry.request_id, queue_key(rec.sampling_session_id, req.seq_id))
            work = self._run_sample(full, charge)
            self._spawn(entry, self._remember(entry, key, work) if req.seq_id else work)
        else:  # another request holds its seq_id and samples: this one samples nothing
            self.quotas.settle_sample(tenant, charge, 0)
        return pb.SubmitResponse(request_id=holder)

    async def _run_sample(self, req: pb.SampleRequest, charge: Charge | None = None) -> pb.FutureResult:
        """Sample; then settle the tokens its admission charged (``charge``; None: admitted before a restart, so its
        sampled tokens are charged now) with those it sampled (none if it failed or was cancelled)."""
        sampled = 0
        try:
            sampler = self.router.sampler(req.base_model, req.sampling_session_id)
            res: pb.SampleResult = await self._call(sampler.Sample, req, work=True)
            if res.WhichOneof("result") == "error":
                return pb.FutureResult(receipt=res.receipt, error=res.error)
            sampled = sum(len(s.tokens) for s in res.sample.sequences)
            return pb.FutureResult(receipt=res.receipt, sample=res.sample)
        finally:
            self.quotas.settle_sample(req.tenant, charge, sampled)

    # ---- restart ----

    def restore(self) -> int:
        """Load the registries from the store and send each operation still pending on again (a run whose
        creation finished is ready); returns how many were pending. Call once, in the event loop, before serving."""
        loaded = self.store.load()
        self.book.load(loaded.sessions, loaded.sampling)
        self.runs = {r.model_id: r for r in loaded.runs}
        creating = {op.request_id for op in loaded.pending if op.kind == "create_model"}
        for run in self.runs.values():
            if run.create_request_id not in creating:
                run.ready.set()
        for op in loaded.pending:
            entry = self.futures.create(op.tenant, op.request_id)
            if op.kind == "sample":
                self.completions.watch(op.request_id, queue_key(op.key, op.seq_id or 0))
            work = self._resume(op)
            if op.seq_id is not None:
                work = self._remember(entry, (op.key, op.seq_id), work)
            self._spawn(entry, work)
        return len(loaded.pending)

    async def _resume(self, op: Operation) -> pb.FutureResult:
        """Run a recorded operation again: the trainer and the sampler take a repeat as the same request."""
        if op.kind == "sample":
            return await self._run_sample(pb.SampleRequest.FromString(op.request))
        run = self.runs.get(op.key)
        if run is None:  # its creation failed and was forgotten before the operation's own result was recorded
            raise NotFound(f"unknown model_id {op.key!r}")
        if op.kind == "create_model":
            return await self._create_adapter(run, pb.CreateAdapterRequest.FromString(op.request))
        trainer_op = pb.TrainerOp.FromString(op.request)
        if op.sampling_seq_id is not None:
            return await self._save_then_bind(run, trainer_op, op.sampling_seq_id)
        return await self._run_op(run, trainer_op)
