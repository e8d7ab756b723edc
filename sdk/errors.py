"""One error model for every Lathe room and both front doors.

The core raises these; the gRPC door maps them to status codes (``grpc_status`` / ``from_rpc_error``),
the Tinker HTTP door to an HTTP status and an ``{"error", "category"}`` body. No handler invents its
own error text: the message is written once, where the problem is found, and names the field and value.
"""

from __future__ import annotations

import grpc


class LatheError(Exception):
    """Base class. ``status`` is the gRPC code, ``http_status`` the Tinker door's, ``category`` Tinker's."""

    status: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http_status: int = 500
    category: str = "server"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class InvalidArgument(LatheError):
    status, http_status, category = grpc.StatusCode.INVALID_ARGUMENT, 400, "user"


class RequestTooLarge(InvalidArgument):
    """A request body over the door's size limit (HTTP 413: not retried, as any other invalid argument)."""

    http_status = 413


class NotFound(LatheError):
    status, http_status, category = grpc.StatusCode.NOT_FOUND, 404, "user"


class AlreadyExists(LatheError):
    status, http_status, category = grpc.StatusCode.ALREADY_EXISTS, 409, "user"


class PermissionDenied(LatheError):
    status, http_status, category = grpc.StatusCode.PERMISSION_DENIED, 403, "user"


class Unauthenticated(LatheError):
    status, http_status, category = grpc.StatusCode.UNAUTHENTICATED, 401, "user"


class FailedPrecondition(LatheError):
    status, http_status, category = grpc.StatusCode.FAILED_PRECONDITION, 400, "user"


class SessionGone(FailedPrecondition):
    """The session has finished (closed by its client, or expired for want of heartbeats): HTTP 410, on which the
    official SDK stops its heartbeat loop."""

    http_status = 410


class Cancelled(LatheError):
    """The caller cancelled the request before it finished (HTTP 499, nginx's "client closed request")."""

    status, http_status, category = grpc.StatusCode.CANCELLED, 499, "user"


class ResourceExhausted(LatheError):
    """Quota, capacity or a full queue; carries ``retry_after_s`` when the caller should come back."""

    status, http_status, category = grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "user"


class Unavailable(LatheError):
    status, http_status, category = grpc.StatusCode.UNAVAILABLE, 503, "server"


class Internal(LatheError):
    status, http_status, category = grpc.StatusCode.INTERNAL, 500, "server"


_BY_STATUS: dict[grpc.StatusCode, type[LatheError]] = {
    cls.status: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        Unauthenticated,
        FailedPrecondition,
        Cancelled,
        ResourceExhausted,
        Unavailable,
        Internal,
    )
}


def error_for_status(status: grpc.StatusCode, message: str) -> LatheError:
    """The core error for a gRPC status code (unknown codes become ``Internal``)."""
    return _BY_STATUS.get(status, Internal)(message)


def from_rpc_error(err: grpc.RpcError) -> LatheError:
    """Turn a failed call (sync or aio) back into the core error the server raised."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(details or "service unavailable")
    return error_for_status(code, details or str(code))
