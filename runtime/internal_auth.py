"""Trust between Lathe's services: only callers that hold the stack's shared secret reach trainer, sampler and
checkpoints (torch-free; owned here, used by ``lathe.runtime.serving``, the checkpoints server, the gateway core and
the checkpoints client; it imports nothing of Lathe's but the error model).

The secret is a random token that the launcher generates (``lathe serve`` / ``lathe.stack``) or the deployment
stores in a Secret. It reaches each process through the environment, ``LATHE_INTERNAL_TOKEN``, or a file named by
``LATHE_INTERNAL_TOKEN_FILE`` (never argv, which ``ps`` shows). Internal clients send it as the gRPC metadata
entry ``x-lathe-internal-token``; internal servers check it in constant time and answer UNAUTHENTICATED otherwise,
before the request is even deserialized. The gRPC health service (``OPEN_PREFIX``) is the one exception.

A service started without a secret serves anyone, so it may listen on loopback only (for tests and local runs;
it says so on stderr at start) and refuses to start on any other address.
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import logging
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from lathe.errors import FailedPrecondition

TOKEN_ENV = "LATHE_INTERNAL_TOKEN"
TOKEN_FILE_ENV = "LATHE_INTERNAL_TOKEN_FILE"
METADATA_KEY = "x-lathe-internal-token"
REFUSAL = "this service answers Lathe's own services only (missing or wrong internal token)"
OPEN_PREFIX = "/grpc.health.v1.Health/"  # health probes (kubelet's carry no secret) say only SERVING or not


def new_token() -> str:
    """A fresh secret for one stack (256 random bits)."""
    return secrets.token_urlsafe(32)


def load_token(environ: Mapping[str, str] = os.environ) -> str:
    """The secret this process holds ("" when none): the file named by ``LATHE_INTERNAL_TOKEN_FILE`` if set,
    else ``LATHE_INTERNAL_TOKEN``."""
    path = environ.get(TOKEN_FILE_ENV)
    token = Path(path).read_text() if path else environ.get(TOKEN_ENV, "")
    return token.strip()


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listen address) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ---------- server side ----------


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)


async def _deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
    yield  # pragma: no cover - makes this an async generator, as a streaming handler must be


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that refuses the call without reading its request."""
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_deny)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_deny_stream)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_deny)
    return grpc.stream_stream_rpc_method_handler(_deny_stream)


class RequireToken(grpc.aio.ServerInterceptor):
    """Lets a call through only when its ``x-lathe-internal-token`` metadata equals the secret."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the internal token must not be empty")
        self._token = token.encode()

    def holds_token(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        sent = [v for k, v in metadata or () if k == METADATA_KEY]
        if len(sent) != 1:
            return False
        value = sent[0].encode() if isinstance(sent[0], str) else sent[0]
        return hmac.compare_digest(value, self._token)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIX) or self.holds_token(details.invocation_metadata):
            return handler
        return _refusal(handler)


def server_interceptors(name: str, host: str, environ: Mapping[str, str] = os.environ) -> list[RequireToken]:
    """The interceptors an internal service named ``name`` listening on ``host`` must install."""
    token = load_token(environ)
    if token:
        return [RequireToken(token)]
    if not is_loopback(host):
        raise FailedPrecondition(f"{name} would accept calls from anyone on {host}: set {TOKEN_ENV} (or "
                                 f"{TOKEN_FILE_ENV}) to the stack's shared secret, or listen on loopback")
    logging.getLogger(name).warning("no %s set, so any local process may call this service (loopback only)",
                                    TOKEN_ENV)
    return []


# ---------- client side ----------


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                            "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


def _with_token(metadata: Sequence[tuple[str, str]] | None, token: str) -> list[tuple[str, str]]:
    return [*(metadata or ()), (METADATA_KEY, token)]


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, _with_token(d.metadata, self._token), d.credentials,
                            d.wait_for_ready, getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation: Callable, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation: Callable, details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    intercept_stream_stream = intercept_stream_unary


class _AioToken:
    """Adds the secret to an asyncio call's metadata. ``grpc.aio`` files an interceptor under the first call kind
    whose base class it has (an ``isinstance`` elif chain), so one object cannot serve every kind: ``_AIO_TOKEN_KINDS``
    holds one subclass per kind, and a channel gets one of each."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def _intercept(self, continuation: Callable, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        metadata = grpc.aio.Metadata(*_with_token(details.metadata, self._token))
        return await continuation(details._replace(metadata=metadata), request)


class _AioUnaryUnaryToken(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _AioToken._intercept


class _AioUnaryStreamToken(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _AioToken._intercept


class _AioStreamUnaryToken(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _AioToken._intercept


class _AioStreamStreamToken(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _AioToken._intercept


_AIO_TOKEN_KINDS = (_AioUnaryUnaryToken, _AioUnaryStreamToken, _AioStreamUnaryToken, _AioStreamStreamToken)


ChannelOptions = Sequence[tuple[str, Any]]


def internal_channel(target: str, options: ChannelOptions, token: str | None = None) -> grpc.Channel:
    """A blocking channel to an internal service that sends this process's secret with every call."""
    token = load_token() if token is None else token
    channel = grpc.insecure_channel(target, options=options)
    return grpc.intercept_channel(channel, _SyncToken(token)) if token else channel


def internal_aio_channel(target: str, options: ChannelOptions, token: str | None = None) -> grpc.aio.Channel:
    """An asyncio channel to an internal service that sends this process's secret with every call."""
    token = load_token() if token is None else token
    return grpc.aio.insecure_channel(target, options=options,
                                     interceptors=[kind(token) for kind in _AIO_TOKEN_KINDS] if token else None)
