"""What every Tinker HTTP handler reads and answers: request bodies read under the gateway's limits, JSON
responses, and core errors in the ``{"error", "category"}`` shape the official SDK reads.

``Bodies`` owns the reading of a body and holds no state but its limits and the decode gate: a body longer than the
core's ``limits.max_message_bytes`` is refused with 413 before it is read to its end; a ``Content-Encoding: zstd``
body (the SDK's compressed forward_backward) is inflated a piece at a time and refused with 413 as soon as it passes
``HttpLimits.max_inflated_bytes`` or the tenant's quota of that name; a body holding more than ``max_request_tokens``
values is refused before they become Python lists; and only ``max_concurrent_decodes`` large or compressed bodies
are decoded at once (``limits.DecodeGate``).
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import AsyncIterator
from typing import Any

import zstandard
from starlette.requests import Request
from starlette.responses import Response

from lathe.errors import InvalidArgument, LatheError, RequestTooLarge

from .core import GatewayCore
from .json_fields import INT32_MAX, Fields
from .limits import SMALL_BODY_BYTES, DecodeGate, HttpLimits

PREFIX = "/api/v1"  # where the Tinker routes are mounted
INFLATE_PIECE_BYTES = 1 << 20  # a zstd body is inflated this much at a time


def json_response(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body), status, headers, media_type="application/json")


def error_response(err: LatheError) -> Response:
    """A core error as Tinker's SDK reads it. Client errors say ``x-should-retry: false`` so the SDK's HTTP
    layer does not resend them; a quota error says when to come back, or, when waiting frees nothing (a 429
    without ``retry_after_s``), not to retry either."""
    headers = {}
    if err.retry_after_s is not None:
        headers["retry-after"] = str(max(1, round(err.retry_after_s)))
    if 400 <= err.http_status < 500 and (err.http_status not in (408, 429) or err.retry_after_s is None):
        headers["x-should-retry"] = "false"
    return json_response({"error": err.message, "category": err.category}, err.http_status, headers)


def query_int(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 10 and int(raw) <= INT32_MAX):
        raise InvalidArgument(f"query parameter {name} = {raw[:32]!r} must be an integer in [0, {INT32_MAX}]")
    return int(raw)


class Bodies:
    """Reads request bodies under the core's ``max_message_bytes``, ``limits`` and the tenants' quotas."""

    def __init__(self, core: GatewayCore, limits: HttpLimits, gate: DecodeGate) -> None:
        self.core = core
        self.limits = limits
        self.gate = gate

    @contextlib.asynccontextmanager
    async def read(self, request: Request) -> AsyncIterator[bytes]:
        """The request body while it is decoded: read no further than ``max_message_bytes``, a zstd one inflated
        no further than ``max_inflated_bytes`` (the gateway's, or its tenant's quota if smaller), a large or
        compressed one holding a place in the decode gate."""
        cap = self.core.limits.max_message_bytes
        declared = request.headers.get("content-length", "")
        known = declared.isascii() and declared.isdigit()
        if known and int(declared) > cap:
            raise RequestTooLarge(f"the request body has {declared} bytes, over the limit of {cap} bytes")
        encoding = request.headers.get("content-encoding", "identity")
        if encoding not in ("identity", "zstd"):
            raise InvalidArgument(f"Content-Encoding {encoding!r} is not accepted; send 'zstd' or 'identity'")
        async with self.gate.place(encoding == "zstd" or not known or int(declared) > SMALL_BODY_BYTES):
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > cap:
                    raise RequestTooLarge(f"the request body is over the limit of {cap} bytes")
                chunks.append(chunk)
            body = b"".join(chunks)
            yield body if encoding == "identity" else self._inflate(body, request.state.tenant)

    def _inflate(self, body: bytes, tenant: str) -> bytes:
        """A zstd body decompressed piece by piece, refused as soon as it passes the gateway's
        ``max_inflated_bytes`` or the tenant's quota of that name, whichever is smaller."""
        mine, cap = self.core.quotas.of(tenant).max_inflated_bytes, self.limits.max_inflated_bytes
        limit, pieces, size = min(cap, mine), [], 0
        which = "the tenant's max_inflated_bytes quota" if mine < cap else "max_inflated_bytes"
        try:
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
                while piece := reader.read(INFLATE_PIECE_BYTES):
                    size += len(piece)
                    if size > limit:
                        raise RequestTooLarge(f"the zstd request body ({len(body)} bytes) decompresses to over the "
                                              f"limit of {limit} bytes ({which})")
                    pieces.append(piece)
        except zstandard.ZstdError as e:
            raise InvalidArgument(f"the zstd request body does not decompress: {e}") from None
        return b"".join(pieces)

    async def fields(self, request: Request) -> Fields:
        """The JSON body of ``request``, read under the limits (``read``)."""
        async with self.read(request) as body:
            return Fields.parse(body, self.limits.max_request_tokens)
