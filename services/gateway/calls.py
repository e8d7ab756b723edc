"""How the gateway calls its internal services: every call has a deadline; an idempotent one is retried.

``Caller.call(rpc, request, deadline_s, idempotent)`` awaits one unary gRPC call and turns its failure
into a ``lathe.errors`` exception. When the call is idempotent and fails with UNAVAILABLE (the service is
restarting, or its connection broke), it is made again after a capped exponential backoff, for at most
``retry_budget_s``; after that the caller gets ``Unavailable`` saying how long it waited and gRPC's last word
(which names the service's address).
Idempotent here: trainer ``Run`` (the trainer's sequencer answers a repeat of ``(model_id, seq_id)`` with its
first result), ``CreateAdapter`` (by model id), ``Capabilities``, sampler ``Sample`` (nothing changes state),
checkpoints ``Stat`` and ``List``. Checkpoints ``Delete`` is not (a repeat of a delete that went through says
NOT_FOUND), so it is made once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from lathe.backoff import Backoff
from lathe.channels import reconnect_options
from lathe.errors import Unavailable, from_rpc_error

RECONNECT_OPTIONS = reconnect_options(0.1, 1.0)  # the gateway's channels to the services it calls


@dataclass(frozen=True, slots=True)
class CallPolicy:
    quick_s: float = 60.0
    """deadline of a query (capabilities, checkpoint stat/list/delete)"""
    work_s: float = 3600.0
    """deadline of a model operation, adapter creation or sample (it may wait in a queue)"""
    retry_first_s: float = 0.1
    """first backoff after UNAVAILABLE, doubling up to retry_max_s"""
    retry_max_s: float = 2.0
    """the longest backoff"""
    retry_budget_s: float = 120.0
    """how long an idempotent internal call waits for its service to come back"""

    def __post_init__(self) -> None:
        if not (0 < self.retry_first_s <= self.retry_max_s and self.retry_budget_s >= 0
                and self.quick_s > 0 and self.work_s > 0):
            raise ValueError(f"CallPolicy needs positive deadlines, 0 < retry_first_s <= retry_max_s and "
                             f"retry_budget_s >= 0, got {self}")


class Caller:
    def __init__(self, policy: CallPolicy | None = None) -> None:
        self.policy = policy or CallPolicy()

    async def call(self, rpc: Callable[..., Awaitable[Any]], request: Any, *, deadline_s: float,
                   idempotent: bool) -> Any:
        p = self.policy
        backoff = Backoff(p.retry_first_s, p.retry_max_s, p.retry_budget_s)
        while True:
            try:
                return await rpc(request, timeout=deadline_s)
            except grpc.aio.AioRpcError as e:
                if not idempotent or e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise from_rpc_error(e) from None
                if (pause := backoff.next()) is None:
                    raise Unavailable(f"an internal service has been unavailable for {p.retry_budget_s:.0f} s "
                                      f"(last error: {e.details()}); try again later") from None
            await asyncio.sleep(pause)

    async def send(self, rpc: Callable[..., Awaitable[Any]], request: Any, *, work: bool = False,
                   idempotent: bool = True) -> Any:
        """``call`` under the policy's deadline: ``work_s`` for ``work`` (a model operation, adapter creation or
        sample, which may queue), else ``quick_s``; retried while its service is unavailable when ``idempotent``."""
        return await self.call(rpc, request, deadline_s=self.policy.work_s if work else self.policy.quick_s,
                               idempotent=idempotent)
