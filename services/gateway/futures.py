"""Futures: request id -> eventual result, awaited by long-poll, never by a busy loop.

Memory is bounded: the results outstanding per tenant are counted (``pending``) and capped by the tenant's
``max_inflight_ops`` quota, which the core checks before it creates one (``quotas``), and the most recent
finished ones remembered, at most ``keep_done`` of them and ``keep_bytes`` bytes of results (a sample's can be
megabytes; the oldest go first, the newest always stays; ``on_drop`` hears of each, so what refers to it can go
too). A request still running is never dropped. A dropped request's id is remembered (as many as ``keep_done``)
so that asking for it says its result expired here, rather than that it never existed. This is the live side of
the ledger: the waiters and the recent results; ``store.ControlStore`` holds the durable side, which answers for
an expired result it still holds.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from lathe.errors import NotFound
from lathe.v1 import lathe_pb2 as pb

KEEP_DONE = 100_000  # completed results remembered, oldest dropped first
KEEP_DONE_BYTES = 256 << 20  # ... and their bytes (``pb.FutureResult.ByteSize``)


@dataclass(slots=True)
class Entry:
    request_id: str
    tenant: str
    created: float = field(default_factory=time.monotonic)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: pb.FutureResult | None = None
    seq_key: tuple[str, int] | None = None  # the (model or sampling session, seq_id) it answers, if any
    task: asyncio.Task | None = None  # the work producing its result, while it runs here


class FutureStore:
    def __init__(self, keep_done: int = KEEP_DONE, keep_bytes: int = KEEP_DONE_BYTES,
                 on_drop: Callable[[Entry], None] | None = None) -> None:
        if keep_done < 1 or keep_bytes < 1:
            raise ValueError(f"keep_done and keep_bytes must be >= 1, got {keep_done} and {keep_bytes}")
        self._entries: dict[str, Entry] = {}
        self._done: OrderedDict[str, int] = OrderedDict()  # finished request id -> its result's bytes, oldest first
        self._done_bytes = 0
        self._expired: OrderedDict[str, str] = OrderedDict()  # dropped request ids -> tenant, oldest first
        self._pending: dict[str, int] = {}
        self.keep_done, self.keep_bytes = keep_done, keep_bytes
        self._on_drop = on_drop

    def __len__(self) -> int:
        return len(self._entries)

    def pending(self, tenant: str) -> int:
        """How many of ``tenant``'s results are not finished yet."""
        return self._pending.get(tenant, 0)

    def pending_all(self) -> int:
        """Every tenant's unfinished requests."""
        return sum(self._pending.values())

    def create(self, tenant: str, request_id: str = "") -> Entry:
        """A pending request of ``tenant``: a new id, or ``request_id`` (one the ledger recorded before a restart)."""
        entry = Entry(request_id or "req-" + uuid.uuid4().hex, tenant)
        self._entries[entry.request_id] = entry
        self._pending[tenant] = self._pending.get(tenant, 0) + 1
        return entry

    def discard(self, entry: Entry) -> None:
        """Forget a request that was never submitted (another request holds its ``seq_id``, or recording failed)."""
        if self._entries.pop(entry.request_id, None) is not None and entry.result is None:
            self._settle(entry.tenant)

    def _settle(self, tenant: str) -> None:
        self._pending[tenant] -= 1
        if not self._pending[tenant]:
            del self._pending[tenant]

    def complete(self, entry: Entry, result: pb.FutureResult) -> None:
        if entry.result is not None:
            return
        result.request_id = entry.request_id
        result.done = True
        entry.result = result
        entry.done.set()
        self._settle(entry.tenant)
        size = result.ByteSize()
        self._done[entry.request_id] = size
        self._done_bytes += size
        while len(self._done) > self.keep_done or (self._done_bytes > self.keep_bytes and len(self._done) > 1):
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        request_id, size = self._done.popitem(last=False)
        self._done_bytes -= size
        dropped = self._entries.pop(request_id)
        self._expired[request_id] = dropped.tenant
        if len(self._expired) > self.keep_done:
            self._expired.popitem(last=False)
        if self._on_drop is not None:
            self._on_drop(dropped)

    def get(self, request_id: str, tenant: str) -> Entry:
        """The tenant's request; NotFound for anyone else's, and, naming the limits, for one whose result expired."""
        entry = self._entries.get(request_id)
        if entry is None and self._expired.get(request_id) == tenant:
            raise NotFound(f"request_id {request_id!r} has expired: its result was dropped from the gateway's memory "
                           f"of finished results, which keeps the newest {self.keep_done} of them and at most "
                           f"{self.keep_bytes} bytes (--keep-result-bytes); retrieve results soon after they finish")
        if entry is None or entry.tenant != tenant:
            raise NotFound(f"unknown request_id {request_id!r}")
        return entry

    async def wait(self, entry: Entry, timeout_s: float) -> pb.FutureResult:
        """The result, or ``done=False`` if it is not ready within ``timeout_s``."""
        try:
            await asyncio.wait_for(entry.done.wait(), timeout=max(0.0, timeout_s))
        except TimeoutError:
            return pb.FutureResult(request_id=entry.request_id, done=False)
        assert entry.result is not None
        return entry.result
