"""The gateway core, shared by both front doors (gRPC ``lathe.v1.Gateway`` and the Tinker HTTP API): a facade
that builds the gateway's parts and hands each door the same ones.

Who owns what:
- ``ledger.Ledger``: requests (futures, the idempotency map ``(model_id, seq_id) -> request id``, the operation
  rows, samples' completion queues, the tasks producing results).
- ``sessions.SessionBook``: sessions and sampling sessions (id -> pinned policy version).
- ``runs.Runs``: the training-run registry and ordered operations (``rebuild`` when a trainer lost a run).
- ``sampling.Sampling``: sampling clients and samples.
- ``registry.Registry``: a tenant's listings and checkpoint management.
- ``lookups.Lookups``: the served models (capabilities) and checkpoint stats.
Routing to the trainer and sampler of the pool serving a base model is ``routing.PoolRouter``'s over a
``discovery.PoolDirectory``; internal calls are ``calls.Caller``'s. The core holds no model state and imports no
torch.

Every request is checked at the door before anything is registered (``limits``, ``quotas``): a refused one
leaves no state behind. A full trainer queue is met at the door (``backpressure``): new training operations of
the tenant for that pool are refused (429, retry after) while one already accepted waits for a place.

Durable (``store.ControlStore``, written through before each answer): sessions, runs, sampling sessions and
the ledger of operations; ``restore`` loads all of it when the gateway starts and sends the operations still
pending to the trainer or sampler again (the trainer answers a repeat of a ``seq_id`` with its first result). In
memory only: the waiters and recent results, capabilities. Replicas: several gateways may share one database;
lookups read through to it, and the database numbers a session's runs and sampling clients and names the request
that holds a ``(model_id, seq_id)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from lathe.channels import CHANNEL_OPTIONS
from lathe.runtime.internal_auth import internal_aio_channel
from lathe.v1 import checkpoints_pb2_grpc as cpb_grpc
from lathe.v1 import lathe_pb2 as pb

from .backpressure import TrainerBackpressure
from .calls import RECONNECT_OPTIONS, Caller, CallPolicy
from .discovery import PoolDirectory, StaticDirectory
from .futures import KEEP_DONE_BYTES
from .ledger import Ledger
from .limits import RequestLimits
from .lookups import Lookups
from .metrics import GatewayMetrics
from .quotas import Quotas
from .records import Operation
from .registry import Registry
from .routing import PoolRouter
from .runs import Runs
from .sampling import Sampling
from .sessions import SESSION_IDLE_S, SessionBook
from .stability import StabilityRecords
from .store import ControlStore


class GatewayCore:
    def __init__(self, trainer_target: str, checkpoints_target: str, sampler_target: str,
                 limits: RequestLimits | None = None, quotas: Quotas | None = None, store: ControlStore | None = None,
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
        self.limits = limits or RequestLimits()
        self.quotas = quotas or Quotas()
        self.backpressure = TrainerBackpressure()
        self.store = store or ControlStore()
        self.caller = Caller(calls)
        self.router = PoolRouter(pools or StaticDirectory(trainer_target, sampler_target), self.caller)
        self._channel = internal_aio_channel(checkpoints_target, [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS])  # + secret
        self.checkpoints = cpb_grpc.CheckpointsStub(self._channel)
        self.ledger = Ledger(self.store, self.metrics, keep_result_bytes, self.queue_state)
        self.lookups = Lookups(self.router, self.limits, self.caller, self.checkpoints)
        self.book = SessionBook(self.store, self.quotas, session_idle_s, clock)
        self.stability = StabilityRecords(self.store, lambda tenant: self.quotas.of(tenant).max_sequence_records)
        self.sampling = Sampling(self.ledger, self.lookups, self.book, self.caller, self.router, self.limits,
                                 self.quotas, self.stability)
        self.runs = Runs(self.ledger, self.lookups, self.book, self.sampling, self.caller, self.router, self.quotas,
                         self.backpressure)
        self.registry = Registry(self.store, self.book, self.runs, self.lookups, self.caller, self.checkpoints,
                                 self.quotas)

    async def close(self) -> None:
        await self.router.close()
        await self._channel.close()

    def queue_state(self, tenant: str) -> tuple[str, str | None]:
        """Why the tenant's requests wait, as Tinker's ``queue_state`` and a reason: ``paused_capacity`` while a
        trainer queue is full for it (``backpressure``), ``paused_rate_limit`` while one of its own quotas
        (requests in flight, tokens per minute) refuses new work, else ``active``."""
        full = self.backpressure.paused(tenant)
        if full is not None:
            return "paused_capacity", full
        reason = self.quotas.pressure(tenant, self.ledger.pending(tenant))
        return ("active", None) if reason is None else ("paused_rate_limit", reason)

    def restore(self) -> int:
        """Load the registries from the store and send each operation still pending on again (a run whose
        creation finished is ready); returns how many were pending. Call once, in the event loop, before serving."""
        loaded = self.store.load()
        self.book.load(loaded.sessions, loaded.sampling)
        self.runs.load(loaded.runs, {op.request_id for op in loaded.pending if op.kind == "create_model"})
        self.ledger.resume(loaded.pending, self._resume)
        return len(loaded.pending)

    async def _resume(self, op: Operation) -> pb.FutureResult:
        """Run a recorded operation again: the trainer and the sampler take a repeat as the same request."""
        if op.kind == "sample":
            return await self.sampling.run(pb.SampleRequest.FromString(op.request))
        return await self.runs.resume(op)
