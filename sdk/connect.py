"""Where a client finds the gateway: the only place that reads ``LATHE_BASE_URL`` and ``LATHE_API_KEY``.

``ServiceClient`` and a ``RestClient`` constructed on its own (``RestClient(base_url=..., api_key=...)``, as
tinker 0.38 recommends) both open their ``Connection`` through ``open_connection``.
"""

from __future__ import annotations

import os

from lathe.futures import Connection, RetryPolicy

DEFAULT_BASE_URL = "127.0.0.1:8500"  # where `lathe serve` listens by default


def grpc_target(base_url: str) -> str:
    """``host:port`` from ``"host:port"`` or ``"grpc://host:port"``."""
    scheme, sep, rest = base_url.strip().partition("://")
    target = (rest if sep else scheme).rstrip("/")
    if (sep and scheme != "grpc") or not target or "/" in target:
        raise ValueError(f"base_url {base_url!r} is not a gateway address of the form host:port or "
                         "grpc://host:port (Lathe's SDK speaks gRPC; the HTTP door is for the tinker SDK)")
    return target


def open_connection(base_url: str | None, api_key: str | None, retry: RetryPolicy | None = None) -> Connection:
    """A connection to ``base_url`` (else ``LATHE_BASE_URL``, else the default) with ``api_key`` (else
    ``LATHE_API_KEY``)."""
    target = grpc_target(base_url or os.environ.get("LATHE_BASE_URL") or DEFAULT_BASE_URL)
    return Connection(target, api_key or os.environ.get("LATHE_API_KEY"), retry or RetryPolicy())
