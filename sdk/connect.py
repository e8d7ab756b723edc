"""Where a client finds the gateway and how it talks to it: the only place that reads ``LATHE_BASE_URL`` and
``LATHE_API_KEY``.

``ServiceClient`` and a ``RestClient`` constructed on its own (``RestClient(base_url=..., api_key=...)``, as
tinker 0.38 recommends) both open their ``Connection`` through ``open_connection``.

TLS, as gRPC users expect it: a ``grpcs://`` or ``https://`` base URL, or ``tls=True``, opens a TLS channel
(``grpc.ssl_channel_credentials``) that trusts the system's certificate authorities (or the file named by
gRPC's own ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH``), or ``root_certificates`` (PEM bytes, or the path of a PEM
file) for a private CA. ``grpc://`` or a bare ``host:port`` is plaintext.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc

from lathe.futures import Connection, RetryPolicy

DEFAULT_BASE_URL = "127.0.0.1:8500"  # where `lathe serve` listens by default
TLS_SCHEMES = frozenset({"grpcs", "https"})
PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"


def parse_base_url(base_url: str) -> tuple[str, bool]:
    """``(host:port, whether the scheme asks for TLS)`` from ``host:port``, ``grpc://host:port``,
    ``grpcs://host:port`` or ``https://host:port``."""
    scheme, sep, rest = base_url.strip().partition("://")
    target = (rest if sep else scheme).rstrip("/")
    if (sep and scheme != "grpc" and scheme not in TLS_SCHEMES) or not target or "/" in target:
        raise ValueError(f"base_url {base_url!r} is not a gateway address of the form host:port, grpc://host:port "
                         "or grpcs://host:port (Lathe's SDK speaks gRPC; the HTTP door is for the tinker SDK)")
    return target, sep != "" and scheme in TLS_SCHEMES


def grpc_target(base_url: str) -> str:
    """``host:port`` of ``base_url`` (see ``parse_base_url``)."""
    return parse_base_url(base_url)[0]


def read_root_certificates(root_certificates: bytes | str | Path) -> bytes:
    """PEM bytes as given, or read from the file at a path; either must hold a PEM certificate."""
    if isinstance(root_certificates, bytes):
        pem, source = root_certificates, "root_certificates"
    else:
        path = Path(root_certificates)
        try:
            pem = path.read_bytes()
        except OSError as e:
            raise ValueError(f"root_certificates: cannot read {str(path)!r}: {e.strerror}") from None
        source = f"root_certificates file {str(path)!r}"
    if PEM_CERTIFICATE not in pem:
        raise ValueError(f"{source} holds no PEM certificate (a '-----BEGIN CERTIFICATE-----' block)")
    return pem


def channel_credentials(base_url: str, tls: bool | None, root_certificates: bytes | str | Path | None
                        ) -> grpc.ChannelCredentials | None:
    """The TLS credentials ``base_url``, ``tls`` and ``root_certificates`` ask for (None: plaintext).

    ``tls`` None follows the scheme (or the presence of ``root_certificates``); True or False overrides a bare
    ``host:port``, and contradicting the scheme is an error."""
    _, scheme_tls = parse_base_url(base_url)
    if tls is False and (scheme_tls or root_certificates is not None):
        raise ValueError(f"tls=False contradicts {'base_url ' + repr(base_url) if scheme_tls else 'root_certificates'}"
                         ", which asks for TLS")
    if not (tls or scheme_tls or root_certificates is not None):
        return None
    roots = read_root_certificates(root_certificates) if root_certificates is not None else None
    return grpc.ssl_channel_credentials(root_certificates=roots)


def open_connection(base_url: str | None, api_key: str | None, retry: RetryPolicy | None = None, *,
                    tls: bool | None = None, root_certificates: bytes | str | Path | None = None) -> Connection:
    """A connection to ``base_url`` (else ``LATHE_BASE_URL``, else the default) with ``api_key`` (else
    ``LATHE_API_KEY``), over TLS when ``base_url``, ``tls`` or ``root_certificates`` ask for it."""
    url = base_url or os.environ.get("LATHE_BASE_URL") or DEFAULT_BASE_URL
    return Connection(grpc_target(url), api_key or os.environ.get("LATHE_API_KEY"), retry or RetryPolicy(),
                      credentials=channel_credentials(url, tls, root_certificates))
