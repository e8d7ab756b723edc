"""The gateway core, shared by both front doors (gRPC ``lathe.v1.Gateway`` and the Tinker HTTP API).

Owns: sessions, the training-run registry (model id -> tenant, base model, LoRA config, metadata,
last checkpoints), sampling sessions (id -> pinned policy version), futures (request id -> result) and
the idempotency map ``(model_id, seq_id) -> request id``. Routes model operations to the trainer,
samples to the sampler and checkpoint queries to the checkpoints service. It holds no model state and
imports no torch; per-model ``seq_id`` ordering is enforced where operations are applied, in the
trainer's sequencer, so a repeat or an early arrival is safe on every path.

Every request is checked at the door before anything is registered (``limits``): a refused one leaves no
state behind, and a submit that fails on its way in (admission or transport, e.g. a full trainer queue) is
not remembered as the result of its ``seq_id``, so its retry runs. The idempotency map forgets a ``seq_id``
together with its finished future, so it stays as bounded as the futures are.

Ids are Tinker's: runs are ``"{session}:train:{n}"`` and sampling sessions ``"{session}:sample:{n}"``,
where ``n`` is the client's own counter when it sends one (Tinker's SDK computes ids from it) and the
session's next number otherwise; a repeated creation answers the first one.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from lathe.errors import FailedPrecondition, Internal, InvalidArgument, LatheError, NotFound, from_rpc_error
from lathe.internal_auth import internal_aio_channel
from lathe.serving import CHANNEL_OPTIONS
from lathe.types import EPHEMERAL_TTL_S
from lathe.v1 import checkpoints_pb2 as cpb
from lathe.v1 import checkpoints_pb2_grpc as cpb_grpc
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc
from lathe.wire import error_to_proto

from .futures import Entry, FutureStore
from .limits import DoorLimits, check_op

MAX_WAIT_S = 30.0  # a long-poll is held at most this long
CAPABILITIES_TTL_S = 30.0


@dataclass(slots=True)
class Session:
    session_id: str
    tenant: str
    user_metadata: dict[str, str]
    next_model: int = 0
    next_sampler: int = 0
    last_seen: float = field(default_factory=time.time)
    finished: str = ""  # why the client closed it ("success", "errored", ...); "" while open


@dataclass(slots=True)
class Run:
    model_id: str
    tenant: str
    session_id: str
    base_model: str
    lora: pb.LoraConfig
    user_metadata: dict[str, str]
    create_request_id: str = ""
    created_at: float = field(default_factory=time.time)
    last_request_time: float = field(default_factory=time.time)
    last_checkpoint: str = ""
    last_checkpoint_time: float = 0.0
    last_sampler_checkpoint: str = ""
    last_sampler_checkpoint_time: float = 0.0
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set once its adapter exists or failed
    error: LatheError | None = None  # why its adapter could not be created

    async def wait_ready(self) -> None:
        """Wait until the adapter exists; raise why it could not be created if it could not."""
        await self.ready.wait()
        if self.error is not None:
            raise type(self.error)(f"model {self.model_id!r} could not be created: {self.error.message}")

    def proto(self) -> pb.TrainingRun:
        return pb.TrainingRun(
            training_run_id=self.model_id, base_model=self.base_model, lora_config=self.lora,
            created_at=self.created_at, last_request_time=self.last_request_time,
            user_metadata=self.user_metadata, last_checkpoint=self.last_checkpoint,
            last_sampler_checkpoint=self.last_sampler_checkpoint,
        )


@dataclass(slots=True)
class SamplingSession:
    """A policy version a sampling client is bound to: a saved sampler checkpoint or the base model."""

    sampling_session_id: str
    tenant: str
    base_model: str
    model_path: str
    version: float

    def proto(self) -> pb.SamplingSession:
        return pb.SamplingSession(sampling_session_id=self.sampling_session_id, base_model=self.base_model,
                                  model_path=self.model_path)


def join_exactness(caps: pb.ServerCapabilities, sampled: pb.ServerCapabilities) -> None:
    """Copy each model's sampler exactness into the trainer's ``caps``; a model's logprobs are exact when
    both pools checked it, both passed and their fingerprints match (same bits on both sides)."""
    by_name = {m.model_name: m.sampler_exactness for m in sampled.supported_models}
    for m in caps.supported_models:
        if m.model_name in by_name:
            m.sampler_exactness.CopyFrom(by_name[m.model_name])
        t, s = m.trainer_exactness, m.sampler_exactness
        m.logprobs_exact = t.checked and s.checked and t.exact and s.exact and t.fingerprint == s.fingerprint


class GatewayCore:
    def __init__(self, trainer_target: str, checkpoints_target: str, sampler_target: str,
                 limits: DoorLimits | None = None) -> None:
        self.limits = limits or DoorLimits()
        self._channels = [internal_aio_channel(t, CHANNEL_OPTIONS)  # sends the stack's secret
                          for t in (trainer_target, checkpoints_target, sampler_target)]
        self.trainer = pb_grpc.TrainerStub(self._channels[0])
        self.checkpoints = cpb_grpc.CheckpointsStub(self._channels[1])
        self.sampler = pb_grpc.SamplerStub(self._channels[2])
        self.sampling: dict[str, SamplingSession] = {}
        self.futures = FutureStore(on_drop=self._forget)
        self.sessions: dict[str, Session] = {}
        self.runs: dict[str, Run] = {}
        self._by_seq: dict[tuple[str, int], str] = {}  # (model or sampling session id, seq_id) -> request
        self._caps: tuple[float, pb.ServerCapabilities] | None = None
        self._tasks: set[asyncio.Task] = set()

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()

    # ---- plumbing ----

    async def _call(self, rpc, request):  # noqa: ANN001, ANN202 - any unary aio stub method
        try:
            return await rpc(request)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None

    def _spawn(self, entry: Entry, work) -> None:  # noqa: ANN001 - a coroutine producing a FutureResult
        async def runner() -> None:
            try:
                result = await work
            except LatheError as e:
                result = pb.FutureResult(error=error_to_proto(e))
            except Exception as e:  # noqa: BLE001 - any crash becomes the request's error, never a hang
                result = pb.FutureResult(error=pb.Error(code="Internal", message=f"internal error: {e}",
                                                        category="server"))
            self.futures.complete(entry, result)

        task = asyncio.create_task(runner())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
                raise

        return attempt()

    def session(self, tenant: str, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None or s.tenant != tenant:
            raise NotFound(f"unknown session_id {session_id!r}")
        s.last_seen = time.time()
        return s

    def _open_session(self, tenant: str, session_id: str) -> Session:
        """The session, which must still be open to create models or sampling clients in it."""
        s = self.session(tenant, session_id)
        if s.finished:
            raise FailedPrecondition(f"session {session_id!r} has finished ({s.finished}); start a new one")
        return s

    def run(self, tenant: str, model_id: str) -> Run:
        r = self.runs.get(model_id)
        if r is None or r.tenant != tenant:
            raise NotFound(f"unknown model_id {model_id!r}")
        return r

    # ---- sessions and capabilities ----

    def create_session(self, tenant: str, user_metadata: dict[str, str]) -> str:
        sid = "sess-" + uuid.uuid4().hex[:16]
        self.sessions[sid] = Session(sid, tenant, dict(user_metadata))
        return sid

    def finish_session(self, tenant: str, session_id: str, reason: str) -> None:
        """Close a session (the first reason wins); its runs, futures and checkpoints stay."""
        s = self.session(tenant, session_id)
        s.finished = s.finished or reason or "finished"

    async def capabilities(self) -> pb.ServerCapabilities:
        """The trainer's models with both pools' exactness joined (cached while every model is checked)."""
        now = time.monotonic()
        if self._caps is None or now - self._caps[0] > CAPABILITIES_TTL_S:
            caps = await self._call(self.trainer.Capabilities, pb.TrainerCapabilitiesRequest())
            sampled = await self._call(self.sampler.Capabilities, pb.TrainerCapabilitiesRequest())
            join_exactness(caps, sampled)
            caps.limits.CopyFrom(self.limits.proto())
            settled = all(m.trainer_exactness.checked and m.sampler_exactness.checked for m in caps.supported_models)
            self._caps = (now if settled else -math.inf, caps)
        return self._caps[1]

    async def _check_base_model(self, base_model: str) -> int:
        caps = await self.capabilities()
        for m in caps.supported_models:
            if m.model_name == base_model:
                return m.max_context_length
        names = [m.model_name for m in caps.supported_models]
        raise InvalidArgument(f"unknown base_model {base_model!r}; this server serves {names}")

    async def checkpoint(self, tenant: str, path: str) -> cpb.CheckpointInfo:
        """The caller's checkpoint at ``path`` (the checkpoints service refuses anyone else's)."""
        return await self._call(self.checkpoints.Stat, cpb.CheckpointRef(tenant=tenant, path=path))

    # ---- training runs ----

    def _start_run(self, tenant: str, session_id: str, model_seq_id: int | None, adapter: pb.CreateAdapterRequest,
                   user_metadata: dict[str, str]) -> pb.SubmitResponse:
        """Register run ``"{session_id}:train:{n}"`` and create its adapter in the background.

        ``n`` is the client's ``model_seq_id`` (Tinker's SDK computes model ids from it), else the session's
        next number. A repeat of a ``model_seq_id`` answers the first request again; nothing is created twice.
        Synchronous, so that concurrent repeats cannot both get past the check."""
        s = self._open_session(tenant, session_id)
        n = s.next_model if model_seq_id is None else model_seq_id
        if n < 0:
            raise InvalidArgument(f"model_seq_id must be >= 0, got {n}")
        model_id = f"{session_id}:train:{n}"
        known = self.runs.get(model_id)
        if known is not None:
            return pb.SubmitResponse(request_id=known.create_request_id, model_id=model_id)
        s.next_model = max(s.next_model, n + 1)
        entry = self.futures.create(tenant)
        run = Run(model_id, tenant, session_id, adapter.base_model, adapter.lora_config, dict(user_metadata),
                  create_request_id=entry.request_id)
        self.runs[model_id] = run
        adapter.model_id, adapter.tenant = model_id, tenant
        self._spawn(entry, self._create_adapter(run, adapter))
        return pb.SubmitResponse(request_id=entry.request_id, model_id=model_id)

    async def create_model(self, tenant: str, req: pb.CreateModelRequest, model_seq_id: int | None = None
                           ) -> pb.SubmitResponse:
        await self._check_base_model(req.base_model)
        if not 1 <= req.lora_config.rank <= 256:
            raise InvalidArgument(f"lora_config.rank = {req.lora_config.rank} is outside [1, 256]")
        return self._start_run(tenant, req.session_id, model_seq_id, pb.CreateAdapterRequest(
            base_model=req.base_model, lora_config=req.lora_config), dict(req.user_metadata))

    async def create_model_from_state(self, tenant: str, req: pb.CreateModelFromStateRequest,
                                      model_seq_id: int | None = None, base_model: str = "") -> pb.SubmitResponse:
        """A run starting from a saved training state. ``base_model``, when given, must be the state's."""
        info = await self.checkpoint(tenant, req.path)
        if info.kind != "weights":
            raise InvalidArgument(f"path {req.path!r} is a {info.kind} checkpoint; a training client starts "
                                  "from a training state (tinker://<run>/weights/<name>)")
        saved_base = json.loads(info.metadata_json or "{}").get("base_model", "")
        if base_model and base_model != saved_base:
            raise InvalidArgument(f"base_model {base_model!r} is not the base model {saved_base!r} of {req.path!r}")
        return self._start_run(tenant, req.session_id, model_seq_id, pb.CreateAdapterRequest(
            base_model=saved_base, from_path=req.path, with_optimizer=req.with_optimizer), dict(req.user_metadata))

    async def _create_adapter(self, run: Run, req: pb.CreateAdapterRequest) -> pb.FutureResult:
        """Create the run's adapter. Whatever happens, ``run.ready`` is set: whoever waits on the run (its
        info, its operations) then gets the adapter or the error, never an endless wait."""
        try:
            info = await self._call(self.trainer.CreateAdapter, req)
            run.base_model, run.lora = info.base_model, info.lora_config
        except LatheError as e:
            run.error = e
            self.runs.pop(run.model_id, None)
            raise
        except Exception as e:  # noqa: BLE001 - recorded for the waiters, then the request's own error
            run.error = Internal(f"creating the adapter failed: {type(e).__name__}: {e}")
            self.runs.pop(run.model_id, None)
            raise
        finally:
            run.ready.set()
        return pb.FutureResult(create_model=pb.CreateModelOutput(model_id=run.model_id))

    async def get_info(self, tenant: str, model_id: str) -> pb.ModelInfo:
        run = self.run(tenant, model_id)
        await run.wait_ready()
        ctx = await self._check_base_model(run.base_model)
        return pb.ModelInfo(model_id=model_id, base_model=run.base_model, lora_config=run.lora,
                            tokenizer_id=run.base_model, max_context_length=ctx)

    # ---- ordered model operations ----

    async def submit(self, tenant: str, model_id: str, seq_id: int, **op: object) -> pb.SubmitResponse:
        """Submit one ordered operation (exactly one of forward_backward / optim_step / save / load)."""
        return self._submit(tenant, model_id, seq_id, op, self._run_op)

    def _submit(self, tenant: str, model_id: str, seq_id: int, op: dict[str, object],
                work: Callable[[Run, pb.TrainerOp], Awaitable[pb.FutureResult]]) -> pb.SubmitResponse:
        """Register ``(model_id, seq_id)`` once and run ``work`` for it; a repeat gets the first request id."""
        run = self.run(tenant, model_id)
        if seq_id < 1:
            raise InvalidArgument(f"seq_id must be >= 1, got {seq_id}")
        known = self._by_seq.get((model_id, seq_id))
        if known is not None:
            return pb.SubmitResponse(request_id=known, model_id=model_id)
        check_op(op)
        entry = self.futures.create(tenant)
        run.last_request_time = time.time()
        trainer_op = pb.TrainerOp(model_id=model_id, seq_id=seq_id, request_id=entry.request_id, tenant=tenant,
                                  **op)
        self._spawn(entry, self._remember(entry, (model_id, seq_id), work(run, trainer_op)))
        return pb.SubmitResponse(request_id=entry.request_id, model_id=model_id)

    async def _run_op(self, run: Run, op: pb.TrainerOp) -> pb.FutureResult:
        await run.wait_ready()
        res: pb.TrainerResult = await self._call(self.trainer.Run, op)
        out = pb.FutureResult(receipt=res.receipt)
        kind = res.WhichOneof("result")
        getattr(out, kind).CopyFrom(getattr(res, kind))
        if kind == "save":
            if op.save.kind == "weights":
                run.last_checkpoint, run.last_checkpoint_time = res.save.path, time.time()
            else:
                run.last_sampler_checkpoint, run.last_sampler_checkpoint_time = res.save.path, time.time()
        return out

    def save_for_sampling(self, tenant: str, model_id: str, seq_id: int, sampling_seq_id: int
                          ) -> tuple[pb.SubmitResponse, str]:
        """Save the adapter as ephemeral sampler weights and bind sampling session
        ``"{session}:sample:{sampling_seq_id}"`` to them once saved. Returns the submit and that session's id,
        which is known at once (a repeat gets both again)."""
        run = self.run(tenant, model_id)
        sampling_id = f"{run.session_id}:sample:{sampling_seq_id}"
        save = pb.SaveRequest(model_id=model_id, seq_id=seq_id, name=f"ephemeral-s{seq_id}", kind="sampler_weights",
                              ttl_seconds=EPHEMERAL_TTL_S)

        async def save_then_bind(run: Run, op: pb.TrainerOp) -> pb.FutureResult:
            out = await self._run_op(run, op)
            if out.HasField("save"):
                await self.create_sampling_session(tenant, pb.CreateSamplingSessionRequest(
                    session_id=run.session_id, model_path=out.save.path), seq_id=sampling_seq_id)
            return out

        return self._submit(tenant, model_id, seq_id, {"save": save}, save_then_bind), sampling_id

    async def retrieve(self, tenant: str, request_id: str, timeout_s: float) -> pb.FutureResult:
        entry = self.futures.get(request_id, tenant)
        return await self.futures.wait(entry, min(timeout_s, MAX_WAIT_S))

    # ---- listings ----

    def list_runs(self, tenant: str, limit: int, offset: int) -> tuple[list[Run], int]:
        """A page of the tenant's training runs, oldest first (``limit`` 0: 20), and how many there are."""
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
                               checkpoint_type="training" if c.kind == "weights" else "sampler",
                               tinker_path=c.path, time=c.created_at, size_bytes=c.size_bytes,
                               expires_at=c.expires_at,
                               user_metadata=json.loads(c.metadata_json or "{}").get("user_metadata", {}))
            for c in res.checkpoints
        ])

    async def delete_checkpoint(self, tenant: str, path: str) -> None:
        await self._call(self.checkpoints.Delete, cpb.CheckpointRef(tenant=tenant, path=path))

    # ---- sampling ----

    async def create_sampling_session(self, tenant: str, req: pb.CreateSamplingSessionRequest,
                                      seq_id: int | None = None) -> pb.SamplingSession:
        """Bind a sampling client to one policy version: the checkpoint at ``model_path`` as it is now
        (its creation time pins it), or the base model. The id is ``"{session}:sample:{n}"``, ``n`` being the
        client's ``seq_id`` (a repeat returns the session already made) or else the session's next number."""
        self._open_session(tenant, req.session_id)
        if req.model_path:
            info = await self.checkpoint(tenant, req.model_path)
            base_model = json.loads(info.metadata_json or "{}").get("base_model", "")
            version = info.created_at
        elif req.base_model:
            await self._check_base_model(req.base_model)
            base_model, version = req.base_model, 0.0
        else:
            raise InvalidArgument("a sampling client needs model_path or base_model")
        s = self._open_session(tenant, req.session_id)  # after the awaits: numbering is synchronous
        n = s.next_sampler if seq_id is None else seq_id
        if n < 0:
            raise InvalidArgument(f"sampling_session_seq_id must be >= 0, got {n}")
        sid = f"{req.session_id}:sample:{n}"
        if sid not in self.sampling:
            s.next_sampler = max(s.next_sampler, n + 1)
            self.sampling[sid] = SamplingSession(sid, tenant, base_model, req.model_path, version)
        return self.sampling[sid].proto()

    def sampling_session(self, tenant: str, sampling_session_id: str) -> SamplingSession:
        rec = self.sampling.get(sampling_session_id)
        if rec is None or rec.tenant != tenant:
            raise NotFound(f"unknown sampling_session_id {sampling_session_id!r}")
        return rec

    async def sample(self, tenant: str, req: pb.SampleRequest) -> pb.SubmitResponse:
        rec = self.sampling_session(tenant, req.sampling_session_id)
        key = (rec.sampling_session_id, req.seq_id)
        if req.seq_id and key in self._by_seq:
            return pb.SubmitResponse(request_id=self._by_seq[key])
        self.limits.check_sample(req)
        entry = self.futures.create(tenant)
        full = pb.SampleRequest()
        full.CopyFrom(req)
        full.tenant, full.base_model, full.model_path = tenant, rec.base_model, rec.model_path
        full.model_version, full.request_id = rec.version, entry.request_id
        work = self._run_sample(full)
        self._spawn(entry, self._remember(entry, key, work) if req.seq_id else work)
        return pb.SubmitResponse(request_id=entry.request_id)

    async def _run_sample(self, req: pb.SampleRequest) -> pb.FutureResult:
        res: pb.SampleResult = await self._call(self.sampler.Sample, req)
        if res.WhichOneof("result") == "error":
            return pb.FutureResult(receipt=res.receipt, error=res.error)
        return pb.FutureResult(receipt=res.receipt, sample=res.sample)
