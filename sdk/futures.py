"""How results come back: the client's link to the gateway, retries, and ``APIFuture``.

Owns, per ``ServiceClient``:
- ``Connection``: a private asyncio event loop on a daemon thread, one ``grpc.aio`` channel to the gateway
  on that loop, the ``x-api-key`` metadata sent on every call, and the ``RetryPolicy``. Every gateway call
  of the SDK runs as a coroutine on this loop, so a sync caller only blocks on a ``concurrent.futures``
  future and an async caller awaits it on its own loop; no thread is held per waiting request.
- ``APIFuture[T]``: Tinker's future. A model operation is submitted (the gateway answers a request id at
  once) and then long-polled with ``Gateway.RetrieveFuture(request_id, timeout_s=POLL_S)``: the gateway
  holds each poll until the result is ready or ``timeout_s`` has passed, and the poll is repeated until
  ``done``. Polling starts as soon as the submit returns; ``result()`` waits for it and caches the value
  (or the ``lathe.errors`` exception of an ``Error`` result). Each not-done answer says why the tenant's work
  waits (``queue_state``); a poll given ``on_queue_state`` reports it, and ``"active"`` once done.

Calls that fail with UNAVAILABLE are retried with capped exponential backoff within the policy's budget;
a submit is retried as the same request (same ``seq_id``), which the gateway treats as idempotent. A failed
TLS handshake (an untrusted certificate, TLS against a plaintext door) is not retried: it says so at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import threading
import warnings
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import Message

from lathe.backoff import Backoff
from lathe.channels import CHANNEL_OPTIONS
from lathe.errors import FailedPrecondition, Unavailable, from_rpc_error
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc

T = TypeVar("T")
log = logging.getLogger("lathe")

POLL_S = 30.0  # how long the gateway may hold one RetrieveFuture call (it caps this too)
POLL_GRACE_S = 15.0  # extra client-side deadline on a poll before it counts as lost and is retried
MIN_POLL_INTERVAL_S = 0.1  # floor between polls, in case a server answers "not done" without holding
RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
POLL_RETRY_CODES = RETRY_CODES | {grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Backoff for calls that fail with a retryable code: ``first_s``, doubling up to ``max_s``, for at
    most ``budget_s`` per call."""

    first_s: float = 0.1
    max_s: float = 5.0
    budget_s: float = 120.0

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s or self.budget_s < 0:
            raise ValueError(f"RetryPolicy needs 0 < first_s <= max_s and budget_s >= 0, got {self}")


class ExactnessWatch:
    """Reads the receipt of every result a client gets and warns once (per client) when sampled logprobs
    may not equal the trainer's bit for bit: a pool that failed its exactness self-check or runs another engine (an
    SGLang sampler pool: fingerprint "sglang"), or a trainer and a sampler whose fingerprints differ (their bits come
    from different machines or settings)."""

    def __init__(self) -> None:
        self.fingerprints: dict[str, set[str]] = {"trainer": set(), "sampler": set()}
        self.warned = False

    def see(self, receipt: pb.Receipt) -> None:
        if self.warned or not receipt.op:
            return
        pool = "sampler" if receipt.op == "sample" else "trainer"
        if not receipt.exact:
            reason = (f"the {pool} pool that ran {receipt.op!r} (fingerprint {receipt.fingerprint!r}) is not exact: it "
                      "failed its exactness self-check or samples with another engine's kernels (sglang)")
        else:
            self.fingerprints[pool].add(receipt.fingerprint)
            trainer, sampler = self.fingerprints["trainer"], self.fingerprints["sampler"]
            if not (trainer and sampler) or trainer & sampler:
                return
            reason = f"trainer fingerprints {sorted(trainer)} differ from sampler fingerprints {sorted(sampler)}"
        self.warned = True
        warnings.warn(f"Lathe: {reason}; sampled logprobs may not equal the trainer's bit for bit "
                      f"(get_server_capabilities says which pool and why)", RuntimeWarning, stacklevel=2)


class Connection:
    """One ServiceClient's link to the gateway at ``target`` (``host:port``), over TLS when ``credentials`` are
    given; shared by its training and REST clients. Thread-safe: ``spawn`` may be called from any thread."""

    def __init__(self, target: str, api_key: str | None, retry: RetryPolicy,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.target = target
        self._credentials = credentials
        self.retry = retry
        self._metadata = (("x-api-key", api_key),) if api_key else ()
        self._lock = threading.Lock()  # orders spawn against close
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"lathe-client-{target}", daemon=True)
        self._thread.start()
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.GatewayStub = self.spawn(self._open()).result()
        self.exactness = ExactnessWatch()

    async def _open(self) -> pb_grpc.GatewayStub:
        if self._credentials is None:
            self._channel = grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.secure_channel(self.target, self._credentials, options=CHANNEL_OPTIONS)
        return pb_grpc.GatewayStub(self._channel)

    def spawn(self, work: Coroutine[Any, Any, T]) -> cf.Future[T]:
        """Run ``work`` on the connection's loop."""
        with self._lock:
            if self._closed:
                work.close()
                raise FailedPrecondition(f"the client for {self.target} is closed")
            return asyncio.run_coroutine_threadsafe(work, self._loop)

    async def call(self, rpc: str, request: Message, *, timeout: float | None = None,
                   retry_codes: frozenset[grpc.StatusCode] = RETRY_CODES, retry: RetryPolicy | None = None) -> Any:
        """``Gateway.<rpc>(request)`` with the API key; failures become ``lathe.errors`` exceptions. ``retry``
        overrides the connection's policy for this call (a client made with its own ``retry_config``)."""
        method = getattr(self._stub, rpc)
        policy = retry or self.retry
        backoff = Backoff(policy.first_s, policy.max_s, policy.budget_s)
        while True:
            try:
                return await method(request, metadata=self._metadata, timeout=timeout)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and "handshake failed" in (e.details() or "").lower():
                    raise Unavailable(  # a client setting, not a passing outage: retrying would only fail again
                        f"the TLS handshake with the gateway at {self.target} failed, so nothing was sent: its "
                        "certificate must chain to root_certificates (or a system CA) and name this host, and a "
                        f"plaintext gateway needs grpc:// (gRPC said: {e.details()})") from None
                if e.code() not in retry_codes or (pause := backoff.next()) is None:
                    raise from_rpc_error(e) from None
                log.info("Gateway.%s at %s: %s; retrying in %.1f s", rpc, self.target, e.code().name, pause)
            await asyncio.sleep(pause)

    def close(self) -> None:
        """Cancel everything in flight (their futures raise CancelledError), close the channel, stop the loop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _shutdown(self) -> None:
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()


class APIFuture(Generic[T]):
    """A result that will exist: ``.result(timeout)`` in sync code, ``await fut`` or
    ``await fut.result_async(timeout)`` in async code. The value (or error) is cached. Waiting less than it
    takes (a ``timeout``, or cancelling an ``await``) raises ``TimeoutError`` / cancels only the wait, never
    the operation."""

    def __init__(self, future: cf.Future[T], request_id: cf.Future[str] | None = None) -> None:
        self._future = future
        self._request_id = request_id

    @property
    def request_id(self) -> str | None:
        """The gateway's request id, once submitted (blocks until then; raises if the submit failed).
        None for plain queries, which have no server-side future."""
        return None if self._request_id is None else self._request_id.result()

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> T:
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._future)), timeout)

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()

    def __repr__(self) -> str:
        return f"<APIFuture {'done' if self.done() else 'pending'}>"


def call_future(conn: Connection, work: Coroutine[Any, Any, T]) -> APIFuture[T]:
    """An APIFuture of a plain call (no server-side future), e.g. a registry query."""
    return APIFuture(conn.spawn(work))


QueueStateHook = Callable[[str, str | None], None]
"""Told (on the connection's loop) the ``queue_state`` and reason of each answer of a poll."""


def server_future(conn: Connection, submit: Coroutine[Any, Any, str], decode: Callable[[pb.FutureResult], T],
                  on_queue_state: QueueStateHook | None = None) -> APIFuture[T]:
    """An APIFuture of a server-side future: ``submit`` yields its request id, then it is long-polled (telling
    ``on_queue_state``, see ``poll``) and the finished ``FutureResult`` is read with ``decode`` (which raises for an
    ``Error`` result)."""
    request_id: cf.Future[str] = cf.Future()

    async def run() -> T:
        try:
            rid = await submit
        except asyncio.CancelledError:
            request_id.cancel()
            raise
        except Exception as e:
            request_id.set_exception(e)
            raise
        request_id.set_result(rid)
        res = await poll(conn, rid, on_queue_state)
        if res.HasField("receipt"):
            conn.exactness.see(res.receipt)
        return decode(res)

    try:
        return APIFuture(conn.spawn(run()), request_id)
    except FailedPrecondition:  # closed: ``run`` never started, so neither did ``submit``
        submit.close()
        raise


async def poll(conn: Connection, request_id: str, on_queue_state: QueueStateHook | None = None) -> pb.FutureResult:
    """Long-poll ``RetrieveFuture`` until the request is done; each poll waits on the server. ``on_queue_state``
    hears each not-done answer's queue state (``"active"`` from a gateway that names none) and ``"active"`` once
    the request is done, whether it succeeded or failed."""
    loop = asyncio.get_running_loop()
    request = pb.RetrieveFutureRequest(request_id=request_id, timeout_s=POLL_S)
    while True:
        started = loop.time()
        res = await conn.call("RetrieveFuture", request, timeout=POLL_S + POLL_GRACE_S,
                              retry_codes=POLL_RETRY_CODES)
        if on_queue_state is not None:
            if not res.done and res.queue_state:
                on_queue_state(res.queue_state, res.queue_state_reason or None)
            else:
                on_queue_state("active", None)
        if res.done:
            return res
        await asyncio.sleep(max(0.0, MIN_POLL_INTERVAL_S - (loop.time() - started)))
