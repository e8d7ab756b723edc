"""Training runs: the registry of runs and the ordered operations applied to them.

``Runs`` owns the run registry (model id -> ``records.Run``: tenant, base model, LoRA config, metadata, last
checkpoints), read through to the database, where another gateway over it may have made the record. It creates a
run's adapter on the trainer of the pool serving its base model (``routing.PoolRouter``), submits each ordered
operation through the ledger once per ``(model_id, seq_id)``, and applies it on the trainer, offered again while
the trainer's queue is full (``backpressure``) and after rebuilding the run on a trainer that lost it
(``rebuild``). Per-model ``seq_id`` order is enforced where operations are applied, in the trainer's sequencer, so
a repeat or an early arrival is safe on every path. Ids are Tinker's: ``"{session}:train:{n}"``, ``n`` being the
client's own counter when it sends one (Tinker's SDK computes ids from it), else the session's next number; a
repeated creation answers the first one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from collections.abc import Awaitable, Callable, Iterator

from lathe.errors import FailedPrecondition, Internal, InvalidArgument, LatheError, NotFound
from lathe.types import EPHEMERAL_TTL_S, OPTIMIZERS
from lathe.v1 import lathe_pb2 as pb
from lathe.wire import error_from_proto

from .backpressure import TrainerBackpressure
from .calls import Caller
from .downloads import EXPORT_NOTE_KEY
from .ledger import Ledger
from .limits import check_op
from .lookups import Lookups
from .quotas import Quotas, adapter_bytes, lora_of_checkpoint
from .rebuild import REBUILD_ATTEMPTS, rebuild
from .records import Operation, Run
from .routing import PoolRouter
from .sampling import Sampling
from .sessions import SessionBook
from .store import ControlStore


class Runs:
    def __init__(self, ledger: Ledger, lookups: Lookups, book: SessionBook, sampling: Sampling, caller: Caller,
                 router: PoolRouter, quotas: Quotas, backpressure: TrainerBackpressure) -> None:
        self.ledger, self.lookups, self.book, self.sampling = ledger, lookups, book, sampling
        self.caller, self.router, self.quotas, self.backpressure = caller, router, quotas, backpressure
        self.store: ControlStore = ledger.store
        self.by_id: dict[str, Run] = {}

    def load(self, runs: list[Run], creating: set[str]) -> None:
        """After a restart: the runs of the database; those whose creation is not among ``creating`` are ready."""
        self.by_id = {r.model_id: r for r in runs}
        for run in runs:
            if run.create_request_id not in creating:
                run.ready.set()

    async def resume(self, op: Operation) -> pb.FutureResult:
        """Run a recorded training operation again: the trainer takes a repeat as the same request."""
        run = self.by_id.get(op.key)
        if run is None:  # its creation failed and was forgotten before the operation's own result was recorded
            raise NotFound(f"unknown model_id {op.key!r}")
        if op.kind == "create_model":
            return await self._create_adapter(run, pb.CreateAdapterRequest.FromString(op.request))
        trainer_op = pb.TrainerOp.FromString(op.request)
        if op.sampling_seq_id is not None:
            return await self._save_then_bind(run, trainer_op, op.sampling_seq_id)
        return await self._run_op(run, trainer_op)

    def find_any(self, model_id: str) -> Run | None:
        """The run, adopted from the database if another gateway created it: ready at once if its creation
        finished, else once the ledger says it did (``_await_creation``)."""
        run = self.by_id.get(model_id)
        if run is None and (run := self.store.get_run(model_id)) is not None:
            self.by_id[model_id] = run
            created = self.store.get_op(run.create_request_id)
            if created is None or created.result is not None:
                run.ready.set()
            else:
                self.ledger.background(self._await_creation(run))
        return run

    async def _await_creation(self, run: Run) -> None:
        """Set ``run.ready`` once the gateway creating it records the outcome (its error, if it failed)."""
        result = await self.ledger.recorded_result(run.create_request_id, math.inf)
        if result is not None and result.HasField("error"):
            run.error = error_from_proto(result.error)
            self.by_id.pop(run.model_id, None)
        run.ready.set()

    def find(self, tenant: str, model_id: str) -> Run | None:
        """The tenant's run ``model_id``, or None (as ``get`` without the error)."""
        r = self.find_any(model_id)
        return r if r is not None and r.tenant == tenant else None

    def of(self, tenant: str) -> list[Run]:
        """The tenant's runs known here, oldest first."""
        return sorted((r for r in self.by_id.values() if r.tenant == tenant), key=lambda r: r.created_at)

    def get(self, tenant: str, model_id: str) -> Run:
        r = self.find(tenant, model_id)
        if r is None:
            raise NotFound(f"unknown model_id {model_id!r}")
        return r

    def _start(self, tenant: str, session_id: str, model_seq_id: int | None, adapter: pb.CreateAdapterRequest,
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
            known = self.find_any(f"{session_id}:train:{model_seq_id}")
            if known is not None:
                return pb.SubmitResponse(request_id=known.create_request_id, model_id=known.model_id)
        lora = adapter.lora_config if lora is None else lora
        costs = self.lookups.lora_costs
        held = [adapter_bytes(costs.get(base), config, optimizer)
                for base, config, optimizer in self.store.run_configs(tenant)]
        self.quotas.admit_run(tenant, held, adapter_bytes(costs.get(adapter.base_model), lora,
                                                          adapter.optimizer or OPTIMIZERS[0]),
                              self.ledger.pending(tenant), user_metadata)
        n = self.store.number(session_id, "next_model", model_seq_id)  # the database numbers, for every gateway
        s.next_model = max(s.next_model, n + 1)
        model_id = f"{session_id}:train:{n}"
        entry = self.ledger.create(tenant)
        run = Run(model_id, tenant, session_id, adapter.base_model, lora, dict(user_metadata),
                  create_request_id=entry.request_id, optimizer=adapter.optimizer or OPTIMIZERS[0])
        adapter.model_id, adapter.tenant = model_id, tenant
        adapter.max_resident_adapters = self.quotas.of(tenant).max_resident_adapters
        create = Operation(entry.request_id, tenant, model_id, None, "create_model", adapter.SerializeToString())
        try:
            holder = self.store.put_run(run, create)
        except BaseException:
            self.ledger.discard(entry)
            raise
        if holder != entry.request_id:  # another gateway over this database created it first
            self.ledger.discard(entry)
            return pb.SubmitResponse(request_id=holder, model_id=model_id)
        self.by_id[model_id] = run
        self.ledger.spawn(entry, self._create_adapter(run, adapter))
        return pb.SubmitResponse(request_id=entry.request_id, model_id=model_id)

    async def create_model(self, tenant: str, req: pb.CreateModelRequest, model_seq_id: int | None = None
                           ) -> pb.SubmitResponse:
        await self.lookups.check_base_model(req.base_model)
        if not 1 <= req.lora_config.rank <= 256:
            raise InvalidArgument(f"lora_config.rank = {req.lora_config.rank} is outside [1, 256]")
        if req.optimizer not in ("", *OPTIMIZERS):
            raise InvalidArgument(f"optimizer = {req.optimizer!r}: Lathe trains with {' or '.join(OPTIMIZERS)}")
        return self._start(tenant, req.session_id, model_seq_id, pb.CreateAdapterRequest(
            base_model=req.base_model, lora_config=req.lora_config, optimizer=req.optimizer), dict(req.user_metadata))

    async def create_model_from_state(self, tenant: str, req: pb.CreateModelFromStateRequest,
                                      model_seq_id: int | None = None, base_model: str = "") -> pb.SubmitResponse:
        """A run starting from a saved training state. ``base_model``, when given, must be the state's."""
        info = await self.lookups.checkpoint(tenant, req.path)
        if info.kind != "weights":
            raise InvalidArgument(f"path {req.path!r} is a {info.kind} checkpoint; a training client starts "
                                  "from a training state (tinker://<run>/weights/<name>)")
        meta = json.loads(info.metadata_json or "{}")
        saved_base = meta.get("base_model", "")
        if base_model and base_model != saved_base:
            raise InvalidArgument(f"base_model {base_model!r} is not the base model {saved_base!r} of {req.path!r}")
        with contextlib.suppress(LatheError):  # no pool answering: the creation itself fails, and says why
            await self.lookups.capabilities()  # the LoRA costs the adapter-bytes quota reads
        return self._start(tenant, req.session_id, model_seq_id, pb.CreateAdapterRequest(
            base_model=saved_base, from_path=req.path, with_optimizer=req.with_optimizer, optimizer=req.optimizer),
            dict(req.user_metadata), lora_of_checkpoint(meta))

    async def _create_adapter(self, run: Run, req: pb.CreateAdapterRequest) -> pb.FutureResult:
        """Create the run's adapter. Whatever happens, ``run.ready`` is set: whoever waits on the run (its
        info, its operations) then gets the adapter or the error, never an endless wait."""
        try:
            trainer = self.router.trainer(run.base_model, run.model_id)
            info = await self.caller.send(trainer.CreateAdapter, req, work=True)
            run.base_model, run.lora = info.base_model, info.lora_config
            run.optimizer = info.optimizer or run.optimizer  # a state loaded with its optimizer brings its family
            self.store.update_run(run)
        except LatheError as e:
            run.error = e
            self._drop(run)
            raise
        except Exception as e:  # recorded for the waiters, then the request's own error
            run.error = Internal(f"creating the adapter failed: {type(e).__name__}: {e}")
            self._drop(run)
            raise
        finally:
            run.ready.set()
        return pb.FutureResult(create_model=pb.CreateModelOutput(model_id=run.model_id))

    def _drop(self, run: Run) -> None:
        self.by_id.pop(run.model_id, None)
        self.store.delete_run(run.model_id)

    async def get_info(self, tenant: str, model_id: str) -> pb.ModelInfo:
        run = self.get(tenant, model_id)
        await run.wait_ready()
        ctx = await self.lookups.check_base_model(run.base_model)
        return pb.ModelInfo(model_id=model_id, base_model=run.base_model, lora_config=run.lora,
                            tokenizer_id=run.base_model, max_context_length=ctx, optimizer=run.optimizer)

    # ---- ordered model operations ----

    async def submit(self, tenant: str, model_id: str, seq_id: int, **op: object) -> pb.SubmitResponse:
        """Submit one ordered operation (exactly one of forward_backward / optim_step / save / load)."""
        return self.submit_op(tenant, model_id, seq_id, op, self._run_op)

    def submit_op(self, tenant: str, model_id: str, seq_id: int, op: dict[str, object],
                  work: Callable[[Run, pb.TrainerOp], Awaitable[pb.FutureResult]], sampling_seq_id: int | None = None
                  ) -> pb.SubmitResponse:
        """Register ``(model_id, seq_id)`` once and run ``work`` for it; a repeat gets the first request id.
        ``sampling_seq_id``: the sampling session ``work`` binds (recorded, so a restart can do it again)."""
        run = self.get(tenant, model_id)
        if seq_id < 1:
            raise InvalidArgument(f"seq_id must be >= 1, got {seq_id}")
        known = self.ledger.holder((model_id, seq_id))
        if known is not None:
            return pb.SubmitResponse(request_id=known, model_id=model_id)
        with self.refusing(tenant, model_id, seq_id):
            check_op(op)
        self.quotas.admit_op(tenant, self.ledger.pending(tenant), op)
        self.backpressure.admit(run.base_model, tenant, model_id, seq_id)
        entry = self.ledger.create(tenant)
        run.last_request_time = time.time()
        trainer_op = pb.TrainerOp(model_id=model_id, seq_id=seq_id, request_id=entry.request_id, tenant=tenant,
                                  max_checkpoint_bytes=self.quotas.of(tenant).max_checkpoint_bytes, **op)
        holder = self.ledger.record(entry, Operation(entry.request_id, tenant, model_id, seq_id, next(iter(op)),
                                                     trainer_op.SerializeToString(), sampling_seq_id), run)
        if holder == entry.request_id:
            self.ledger.spawn(entry, self.ledger.remember(entry, (model_id, seq_id), work(run, trainer_op)))
        return pb.SubmitResponse(request_id=holder, model_id=model_id)

    @contextlib.contextmanager
    def refusing(self, tenant: str, model_id: str, seq_id: int) -> Iterator[None]:
        """Around the checks of an ordered operation before it is submitted (a door decoding its body, ``submit_op``
        checking its parameters): a client error raised there, which a retry would meet again, passes over its
        ``seq_id`` on the trainer (``_skip``), since the client moves on to the next one. Only for the tenant's own
        run and a ``seq_id`` not already taken; admission and transport errors are not client errors of this kind
        (the client retries them under the same ``seq_id``)."""
        try:
            yield
        except (InvalidArgument, NotFound, FailedPrecondition) as e:
            run = self.find(tenant, model_id)
            if run is not None and seq_id >= 1 and self.ledger.holder((model_id, seq_id)) is None:
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
                await self.caller.send(self.router.trainer(run.base_model, run.model_id).Run, skip)
            except LatheError:
                pass

        self.ledger.background(send())

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
            if op.save.inflight:  # its inflight clients sample from these weights from now on
                info = await self.lookups.checkpoint(run.tenant, res.save.path)
                self.store.set_inflight(run.tenant, run.model_id, res.save.path, info.created_at)
        return out

    async def _apply(self, run: Run, op: pb.TrainerOp) -> pb.TrainerResult:
        """``Trainer.Run(op)``, offered again while the trainer's queue is full (``backpressure``); should the
        trainer not know the run (it restarted and lost it), rebuild the run there first and send ``op`` again."""
        trainer = self.router.trainer(run.base_model, run.model_id)
        for attempt in range(REBUILD_ATTEMPTS):
            seen = run.rebuilds
            try:
                return await self.backpressure.send(run.base_model, run.tenant, run.model_id, op.seq_id,
                                                    lambda: self.caller.send(trainer.Run, op, work=True))
            except NotFound:
                if attempt == REBUILD_ATTEMPTS - 1:
                    raise
                await rebuild(run, seen, trainer, self.caller, self.store, self.quotas)
        raise AssertionError("unreachable")

    def save_for_sampling(self, tenant: str, model_id: str, seq_id: int, sampling_seq_id: int,
                          inflight: bool = False) -> pb.SubmitResponse:
        """Save the adapter as ephemeral sampler weights and bind sampling session
        ``"{session}:sample:{sampling_seq_id}"`` to them once saved (``inflight``: publish them as the run's
        inflight weights and bind an inflight session, which follows the run's later inflight saves); the result
        names that session (``SaveOutput.sampling_session_id``). A repeat gets the same request."""
        if self.ledger.holder((model_id, seq_id)) is None:  # refused before the save, not after it
            self.book.admit_sampling(tenant, self.get(tenant, model_id).session_id, sampling_seq_id)
        save = pb.SaveRequest(model_id=model_id, seq_id=seq_id, name=f"ephemeral-s{seq_id}", kind="sampler_weights",
                              ttl_seconds=EPHEMERAL_TTL_S, inflight=inflight)
        work = functools.partial(self._save_then_bind, sampling_seq_id=sampling_seq_id)
        return self.submit_op(tenant, model_id, seq_id, {"save": save}, work, sampling_seq_id)

    async def _save_then_bind(self, run: Run, op: pb.TrainerOp, sampling_seq_id: int) -> pb.FutureResult:
        out = await self._run_op(run, op)
        if out.HasField("save"):
            bind = pb.CreateSamplingSessionRequest(session_id=run.session_id, model_path=out.save.path)
            if op.save.inflight:
                bind = pb.CreateSamplingSessionRequest(session_id=run.session_id, follow_model_id=run.model_id)
            bound = await self.sampling.create_session(run.tenant, bind, seq_id=sampling_seq_id)
            out.save.sampling_session_id = bound.sampling_session_id  # in the result: recorded with it
        return out
