"""The ledger: the one owner of the gateway's requests, from the id it answers to the result it keeps.

Owns the futures (``futures.FutureStore``: request id -> waiters and recent result), the idempotency map
``(model or sampling session id, seq_id) -> request id`` of the submissions running here, the operation rows of
the control store (an operation is recorded, its request included, before its id is answered, and its result
before its future resolves), the samples' completion queues and the tasks that produce results. ``runs`` and
``sampling`` submit through it and the doors read results from it; nothing else writes any of these.

A submission that fails on its way in (a ``LatheError`` from admission or transport) is not remembered as the
result of its ``seq_id``, so its retry runs; the map forgets a ``seq_id`` together with its finished future, so
it stays as bounded as the futures are. A result another gateway over the same database produces is read from
the operation rows (``recorded_result``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

from lathe.backoff import Backoff
from lathe.errors import Cancelled, FailedPrecondition, LatheError, NotFound
from lathe.v1 import lathe_pb2 as pb
from lathe.wire import error_to_proto

from .completions import Completion, CompletionQueues, queue_key
from .futures import Entry, FutureStore
from .metrics import GatewayMetrics
from .records import Operation, Run
from .store import ControlStore

log = logging.getLogger("lathe.gateway")

MAX_WAIT_S = 30.0  # a long-poll is held at most this long
FOREIGN_POLL_FIRST_S = 0.05  # the ledger is read for a result another gateway is producing this soon, then
FOREIGN_POLL_S = 0.5  # at most this far apart
PURGE_EVERY_S = 60.0  # how often finished operations past the retention are deleted from the ledger

Key = tuple[str, int]  # (model or sampling session id, seq_id)


class Ledger:
    def __init__(self, store: ControlStore, metrics: GatewayMetrics, keep_result_bytes: int,
                 queue_state: Callable[[str], tuple[str, str | None]]) -> None:
        """``keep_result_bytes``: the bytes of finished results kept in memory (``futures``); ``queue_state``: why
        a tenant's requests wait, told with every pending answer."""
        self.store, self.metrics, self._queue_state = store, metrics, queue_state
        self.futures = FutureStore(keep_done=store.cfg.keep_done, keep_bytes=keep_result_bytes, on_drop=self._forget)
        self.completions = CompletionQueues()
        self._by_seq: dict[Key, str] = {}
        self._tasks: set[asyncio.Task] = set()
        self._next_purge = 0.0

    def pending(self, tenant: str) -> int:
        """How many of ``tenant``'s requests are not finished yet (what its in-flight quota counts)."""
        return self.futures.pending(tenant)

    def pending_all(self) -> int:
        """Every tenant's requests not finished yet (the pools' queue as the gateway sees it)."""
        return self.futures.pending_all()

    def holder(self, key: Key) -> str | None:
        """The request running here for ``key``, if any."""
        return self._by_seq.get(key)

    def create(self, tenant: str) -> Entry:
        return self.futures.create(tenant)

    def discard(self, entry: Entry) -> None:
        """Let go of an entry that will not run (refused, or another request holds its key)."""
        self.futures.discard(entry)

    # ---- recording and running ----

    def record(self, entry: Entry, op: Operation, run: Run | None = None) -> str:
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

    def spawn(self, entry: Entry, work: Awaitable[pb.FutureResult]) -> None:
        """Produce ``entry``'s result by ``work``; any exception becomes the request's error, never a hang."""
        async def runner() -> None:
            try:
                result = await work
            except LatheError as e:
                result = pb.FutureResult(error=error_to_proto(e))
            except Exception as e:  # noqa: BLE001 - any crash becomes the request's error, never a hang
                result = pb.FutureResult(error=pb.Error(code="Internal", message=f"internal error: {e}",
                                                        category="server"))
            self.finish(entry, result)

        entry.task = self.background(runner())

    def background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Run ``work`` as a task the ledger holds until it ends."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def remember(self, entry: Entry, key: Key, work: Awaitable[pb.FutureResult]) -> Awaitable[pb.FutureResult]:
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

    def finish(self, entry: Entry, result: pb.FutureResult) -> None:
        """Record ``result`` in the ledger, then resolve the future (its key goes if the submit failed on its way
        in); every ``PURGE_EVERY_S`` the ledger drops what is past its retention."""
        result.request_id, result.done = entry.request_id, True
        entry.task = None
        now = time.time()
        try:
            self.store.finish_op(entry.request_id, result, now, release_key=entry.seq_key is None,
                                 tenant=entry.tenant)
            if now >= self._next_purge:
                self._next_purge = now + PURGE_EVERY_S
                self.store.purge(now)
                self.store.purge_records(now)
        except Exception as e:  # noqa: BLE001 - the waiters still get the result; only its record is missing
            log.error("recording the result of %s failed: %s: %s", entry.request_id, type(e).__name__, e)
        self.futures.complete(entry, result)
        self.completions.done(entry.request_id, failed=result.HasField("error"))
        self.metrics.finished(entry.tenant, result)

    def _forget(self, entry: Entry) -> None:
        """Drop the idempotency key of ``entry`` if it still names it (its result is gone, or never came)."""
        if entry.seq_key is not None and self._by_seq.get(entry.seq_key) == entry.request_id:
            del self._by_seq[entry.seq_key]

    def answered(self, tenant: str, result: pb.FutureResult) -> str:
        """The id of a request of ``tenant`` answered at once with ``result`` (nothing to run; the Tinker SDK reads
        every answer through a future). Kept in memory only, as a finished future."""
        entry = self.futures.create(tenant)
        self.futures.complete(entry, result)
        return entry.request_id

    def resume(self, pending: Iterable[Operation], work: Callable[[Operation], Awaitable[pb.FutureResult]]) -> None:
        """After a restart: produce each recorded, unanswered operation's result again by ``work(op)``, under its
        own request id and key."""
        for op in pending:
            entry = self.futures.create(op.tenant, op.request_id)
            if op.kind == "sample":
                self.completions.watch(op.request_id, queue_key(op.key, op.seq_id or 0))
            produced = work(op)
            if op.seq_id is not None:
                produced = self.remember(entry, (op.key, op.seq_id), produced)
            self.spawn(entry, produced)

    # ---- reading ----

    async def recorded_result(self, request_id: str, timeout_s: float) -> pb.FutureResult | None:
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

    async def retrieve(self, tenant: str, request_id: str, timeout_s: float) -> pb.FutureResult:
        """The result (held up to ``timeout_s`` while pending); one no longer in memory comes from the ledger. A
        ``done=False`` answer carries the tenant's ``queue_state`` as it is then (a fresh message each time)."""
        found = self._request(tenant, request_id)
        if isinstance(found, Entry):
            res = await self.futures.wait(found, min(timeout_s, MAX_WAIT_S))
        elif found.result is None:  # pending at another gateway over this database: held while it runs there
            recorded = await self.recorded_result(request_id, min(timeout_s, MAX_WAIT_S))
            res = recorded or pb.FutureResult(request_id=request_id, done=False)
        else:
            return pb.FutureResult.FromString(found.result)
        if not res.done:
            state, reason = self._queue_state(tenant)
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
        self.finish(entry, pb.FutureResult(error=error_to_proto(Cancelled(f"request_id {request_id!r} was "
                                                                            "cancelled by the client"))))
        return True

    async def completed_samples(self, key: tuple[str, int], prev_cursor: int, timeout_s: float
                                ) -> tuple[list[Completion], int]:
        """The samples of one sampling client finished since ``prev_cursor`` (held up to ``timeout_s`` while none
        are), and the cursor to pass next (``completions.CompletionQueues``)."""
        return await self.completions.wait(key, prev_cursor, min(timeout_s, MAX_WAIT_S))
