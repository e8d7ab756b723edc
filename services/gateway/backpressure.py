"""Backpressure from the trainer's queue: refuse new training operations at the door while the queue is full,
and never fail one already accepted because it was.

The trainer bounds its queue (all tenants, and each tenant's share) and answers ``ResourceExhausted`` past it.
An operation the gateway has accepted is in the ledger, its request id answered: failing it would make the
client's retry a new request. So ``send`` keeps such an operation here ("parked") and offers it to the trainer
again every ``retry_after_s`` until a place frees (a repeat of its ``seq_id`` is the same request there), and
while any operation of a ``(pool, tenant)`` is parked, ``admit`` refuses that tenant's new operations for the
pool with ``ResourceExhausted`` + ``retry_after_s`` (HTTP 429 + ``Retry-After``) before anything is recorded,
so a refused request leaves nothing behind and its retry runs once. ``paused`` is the reason a tenant's
futures report ``queue_state: paused_capacity``.

One exception, as in the trainer: an operation whose ``seq_id`` is below every one of its run's that this
gateway is sending may be the one the run waits for (a forward_backward split in chunks sends its first chunk
last), and is let in; refusing it could hold the run's later operations until they time out.

Owns (in memory, per gateway process): the parked counts by ``(pool, tenant)`` and each run's ``seq_id``s being
sent. A pool is named by the base model that routes to it. Touches nothing durable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from lathe.errors import ResourceExhausted

RETRY_AFTER_S = 1.0  # when the trainer says its queue is full without saying when to come back
T = TypeVar("T")


class TrainerBackpressure:
    def __init__(self, retry_after_s: float = RETRY_AFTER_S) -> None:
        self.retry_after_s = retry_after_s
        self._parked: dict[tuple[str, str], int] = {}  # (pool, tenant) -> operations waiting for a place
        self._sending: dict[str, set[int]] = {}  # model id -> seq_ids being sent to the trainer

    def admit(self, pool: str, tenant: str, model_id: str, seq_id: int) -> None:
        """Refuse a new operation of ``tenant`` for ``pool`` while one of its operations there waits for a place
        in the trainer's queue, unless it may be the one its run waits for."""
        if not self._parked.get((pool, tenant)):
            return
        sending = self._sending.get(model_id)
        if sending and seq_id < min(sending):
            return
        raise ResourceExhausted(f"the trainer queue of {pool!r} is full for this tenant ({self._parked[pool, tenant]} "
                                f"operations waiting for a place); retry in {self.retry_after_s:g} s",
                                retry_after_s=self.retry_after_s)

    async def send(self, pool: str, tenant: str, model_id: str, seq_id: int, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` (one operation to the trainer), offered again while the trainer's queue is full."""
        sending = self._sending.setdefault(model_id, set())
        sending.add(seq_id)
        parked = False
        try:
            while True:
                try:
                    return await call()
                except ResourceExhausted as e:
                    if not parked:
                        parked = True
                        self._parked[pool, tenant] = self._parked.get((pool, tenant), 0) + 1
                    await asyncio.sleep(e.retry_after_s or self.retry_after_s)
        finally:
            if parked:
                self._parked[pool, tenant] -= 1
                if not self._parked[pool, tenant]:
                    del self._parked[pool, tenant]
            sending.discard(seq_id)
            if not sending:
                self._sending.pop(model_id, None)

    def paused(self, tenant: str) -> str | None:
        """Why the tenant's training operations wait for capacity (None: they do not)."""
        pools = sorted(pool for pool, who in self._parked if who == tenant)
        return f"the trainer queue of {', '.join(map(repr, pools))} is full" if pools else None
