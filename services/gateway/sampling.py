"""Sampling: binding sampling clients to a policy version, and samples submitted to the sampler pools.

``Sampling`` owns no state of its own but the count of samples in flight outside the ledger (``sample_now``):
sampling sessions are ``SessionBook``'s (id -> pinned policy version, or the run an inflight session follows), each
run's published inflight weights the store's (``set_inflight``), requests and their idempotency the ledger's. It
checks a sample at the door (``limits``), charges the tokens it may sample (``quotas.admit_sample``) and gives back
what it did not sample once it ends. Ids are Tinker's: ``"{session}:sample:{n}"``, ``n`` being the client's own
counter when it sends one, else the session's next number.
"""

from __future__ import annotations

import json
import uuid

from lathe.errors import InvalidArgument, NotFound
from lathe.v1 import lathe_pb2 as pb

from .calls import Caller
from .completions import Completion, queue_key
from .ledger import Ledger
from .limits import RequestLimits
from .lookups import Lookups
from .quotas import Charge, Quotas
from .records import Operation, SamplingSession
from .routing import PoolRouter
from .sessions import SessionBook
from .stability import StabilityRecords


class Sampling:
    def __init__(self, ledger: Ledger, lookups: Lookups, book: SessionBook, caller: Caller, router: PoolRouter,
                 limits: RequestLimits, quotas: Quotas, stability: StabilityRecords) -> None:
        self.ledger, self.lookups, self.book, self.caller, self.router = ledger, lookups, book, caller, router
        self.limits, self.quotas, self.stability = limits, quotas, stability
        self._direct: dict[str, int] = {}  # tenant -> its samples in flight outside the ledger (sample_now)

    async def create_session(self, tenant: str, req: pb.CreateSamplingSessionRequest, seq_id: int | None = None
                             ) -> pb.SamplingSession:
        """Bind a sampling client to one policy version: the checkpoint at ``model_path`` as it is now
        (its creation time pins it), or the base model; or, with ``follow_model_id``, an inflight client of that run,
        which samples each request on the run's inflight weights as published when the request starts (Tinker's
        inflight contract: the weights published when the client was made, or newer). A repeat of ``seq_id``
        returns the session already made."""
        self.book.open(tenant, req.session_id)
        if req.follow_model_id:
            path, version = self.inflight(tenant, req.follow_model_id)
            base_model, _ = await self._checkpoint(tenant, path)
            return self.book.bind_sampling(tenant, req.session_id, seq_id, base_model, path, version,
                                           follows=req.follow_model_id).proto()
        if not (req.model_path or req.base_model):
            raise InvalidArgument("a sampling client needs model_path or base_model")
        base_model, _, version = await self.policy(tenant, req.model_path or req.base_model, req.model_path != "")
        return self.book.bind_sampling(tenant, req.session_id, seq_id, base_model, req.model_path, version).proto()

    def inflight(self, tenant: str, model_id: str) -> tuple[str, float]:
        """The tenant's run ``model_id``'s inflight weights: (sampler checkpoint path, version)."""
        target = self.book.store.inflight(tenant, model_id)
        if target is None:
            raise NotFound(f"model {model_id!r} has published no inflight weights: save them with "
                           "save_weights_and_get_sampling_client(kind='inflight') first")
        return target

    def get(self, tenant: str, sampling_session_id: str) -> SamplingSession:
        return self.book.sampling_session(tenant, sampling_session_id)

    def join(self, tenant: str, sampling_session_id: str) -> int:
        return self.book.join_sampling(tenant, sampling_session_id)

    async def sample(self, tenant: str, req: pb.SampleRequest) -> pb.SubmitResponse:
        """Submit a sample; the tokens it may sample are charged now (``quotas.admit_sample``: without max_tokens,
        what the model's context leaves after the prompt) and what it did not sample is given back once it ends."""
        rec = self.get(tenant, req.sampling_session_id)
        context = 0 if req.params.HasField("max_tokens") else await self.lookups.context_length(rec.base_model)
        key = (rec.sampling_session_id, req.seq_id)
        if req.seq_id and (known := self.ledger.holder(key)) is not None:
            return pb.SubmitResponse(request_id=known)
        self.limits.check_sample(req)
        charge = self.quotas.admit_sample(tenant, self.ledger.pending(tenant), req, context)
        entry = self.ledger.create(tenant)
        full = pb.SampleRequest()
        full.CopyFrom(req)
        path, version = self.inflight(tenant, rec.follows) if rec.follows else (rec.model_path, rec.version)
        full.tenant, full.base_model, full.model_path = tenant, rec.base_model, path
        full.model_version, full.request_id = version, entry.request_id
        holder = self.ledger.record(entry, Operation(entry.request_id, tenant, rec.sampling_session_id,
                                                     req.seq_id or None, "sample", full.SerializeToString()))
        if holder == entry.request_id:
            self.ledger.completions.watch(entry.request_id, queue_key(rec.sampling_session_id, req.seq_id))
            work = self.run(full, charge)
            self.ledger.spawn(entry, self.ledger.remember(entry, key, work) if req.seq_id else work)
        else:  # another request holds its seq_id and samples: this one samples nothing
            self.quotas.settle_sample(tenant, charge, 0)
        return pb.SubmitResponse(request_id=holder)

    async def policy(self, tenant: str, model: str, checkpoint: bool | None = None) -> tuple[str, str, float]:
        """The policy ``model`` names: a checkpoint path of the tenant's (its base model, the path, its version now)
        or a served base model (itself, "", 0). ``checkpoint``: which it is (None: a ``tinker://`` path is one, as
        the OpenAI-compatible routes' ``model`` says)."""
        if model.startswith("tinker://") if checkpoint is None else checkpoint:
            base_model, version = await self._checkpoint(tenant, model)
            return base_model, model, version
        await self.lookups.check_base_model(model)
        return model, "", 0.0

    async def _checkpoint(self, tenant: str, path: str) -> tuple[str, float]:
        """The base model and creation time of the tenant's checkpoint at ``path``."""
        info = await self.lookups.checkpoint(tenant, path)
        return json.loads(info.metadata_json or "{}").get("base_model", ""), info.created_at

    async def sample_now(self, tenant: str, req: pb.SampleRequest) -> pb.FutureResult:
        """Sample for a caller that waits on its connection (no ledger row, no idempotency: the OpenAI-compatible
        routes, whose clients resend a failed call whole). ``req`` names its policy (``base_model``, ``model_path``,
        ``model_version``); the same checks, quotas and fair queue as ``sample``; its in-flight count is the
        tenant's."""
        context = 0 if req.params.HasField("max_tokens") else await self.lookups.context_length(req.base_model)
        self.limits.check_sample(req)
        charge = self.quotas.admit_sample(tenant, self.ledger.pending(tenant) + self._direct.get(tenant, 0), req,
                                          context)
        req.tenant, req.request_id = tenant, f"direct-{uuid.uuid4().hex}"
        self._direct[tenant] = self._direct.get(tenant, 0) + 1
        try:
            return await self.run(req, charge)
        finally:
            self._direct[tenant] -= 1
            if not self._direct[tenant]:
                del self._direct[tenant]

    async def tokenizer_files(self, base_model: str) -> pb.TokenizerFiles:
        """``base_model``'s tokenizer files, from a sampler of its pool."""
        sampler = self.router.sampler(base_model, base_model)
        return await self.caller.send(sampler.Tokenizer, pb.TokenizerRequest(base_model=base_model))

    async def run(self, req: pb.SampleRequest, charge: Charge | None = None) -> pb.FutureResult:
        """Sample; then settle the tokens its admission charged (``charge``; None: admitted before a restart, so its
        sampled tokens are charged now) with those it sampled (none if it failed or was cancelled)."""
        sampled = 0
        try:
            sampler = self.router.sampler(req.base_model, req.sampling_session_id or req.model_path or req.base_model)
            res: pb.SampleResult = await self.caller.send(sampler.Sample, req, work=True)
            if res.WhichOneof("result") == "error":
                return pb.FutureResult(receipt=res.receipt, error=res.error)
            sampled = sum(len(s.tokens) for s in res.sample.sequences)
            if req.record:  # before the result: a datum naming these sequences finds them once it has them
                self.stability.keep(req, res.sample)
            return pb.FutureResult(receipt=res.receipt, sample=res.sample)
        finally:
            self.quotas.settle_sample(req.tenant, charge, sampled)

    async def completed(self, tenant: str, sampling_session_id: str, client: int, prev_cursor: int,
                        timeout_s: float) -> tuple[list[Completion], int]:
        """The samples of one client of the tenant's sampling session finished since ``prev_cursor`` (held up to
        ``timeout_s`` while none are), and the cursor to pass next."""
        self.get(tenant, sampling_session_id)
        if client < 0 or prev_cursor < 0:
            raise InvalidArgument(f"cloned_sampler_id = {client} and prev_cursor = {prev_cursor} must be >= 0")
        return await self.ledger.completed_samples((sampling_session_id, client), prev_cursor, timeout_s)
