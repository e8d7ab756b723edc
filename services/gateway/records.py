"""The gateway's registry records: sessions, training runs and sampling sessions, as the core holds them.

``core.GatewayCore`` keeps them in memory for its requests and writes each one through ``store.ControlStore``,
which maps them to rows; ``Run`` also carries what only a live gateway has (``ready``, ``error``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from lathe.errors import LatheError
from lathe.v1 import lathe_pb2 as pb


@dataclass(slots=True)
class Session:
    session_id: str
    tenant: str
    user_metadata: dict[str, str]
    next_model: int = 0
    next_sampler: int = 0
    last_seen: float = 0.0  # when this gateway last recorded in the database that the session was heard from
    finished: str = ""  # why the client closed it ("success", "errored", ...); "" while open
    created_at: float = field(default_factory=time.time)
    display_name: str | None = None  # a name for people (Tinker's), matched by session search


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
    recovery_seq: int = 0  # the trainer's latest recovery snapshot of it was taken after this seq_id
    optimizer: str = "adamw"  # its optimizer family, fixed at creation ("adamw" | "dimuon"; ``lathe.types``)
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set once its adapter exists or failed
    error: LatheError | None = None  # why its adapter could not be created
    rebuilds: int = 0  # times it was rebuilt on a trainer that had lost it (``rebuild.rebuild``)
    rebuilding: asyncio.Lock = field(default_factory=asyncio.Lock)

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
    """A policy version a sampling client is bound to: a saved sampler checkpoint or the base model; or, for an
    inflight client, the run whose inflight weights it follows (``follows``; ``model_path`` and ``version`` are then
    those published when it was made, and each sample takes those published when it starts)."""

    sampling_session_id: str
    tenant: str
    base_model: str
    model_path: str
    version: float
    follows: str = ""

    def proto(self) -> pb.SamplingSession:
        return pb.SamplingSession(sampling_session_id=self.sampling_session_id, base_model=self.base_model,
                                  model_path=self.model_path)


@dataclass(frozen=True, slots=True)
class SequenceRecord:
    """What a sample recorded of one sampled sequence for training on it later (``record_stability_info``): its
    prompt and sampled tokens (int32 bytes), each sampled token's sampling-time logprob (float32 bytes), the policy
    that sampled it (a sampler checkpoint path or the base model), when it was recorded and when it expires."""

    sequence_id: str
    prompt: bytes
    tokens: bytes
    logprobs: bytes
    policy: str
    created: float
    expires: float


@dataclass(slots=True)
class Operation:
    """One row of the ledger: a request id, what it was asked (``request``: the serialized message sent on,
    per ``kind``) and, once ``state`` is ``"done"``, its serialized ``pb.FutureResult``. ``seq_id`` is set
    while the operation answers ``(key, seq_id)`` (``key``: a model id or sampling session id)."""

    request_id: str
    tenant: str
    key: str
    seq_id: int | None
    kind: str  # "create_model", "forward_backward", "optim_step", "save", "load" or "sample"
    request: bytes
    sampling_seq_id: int | None = None  # a save for sampling: the sampling session it binds once saved
    state: str = "pending"
    result: bytes | None = None
    created: float = field(default_factory=time.time)
    finished: float | None = None
