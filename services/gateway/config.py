"""The gateway's configuration: one frozen dataclass whose fields, and those of the configs it holds, are the flags of
``python -m lathe.gateway`` (``lathe.runtime.options``), checked when made."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import urlparse

from .auth import KEYS_FILE_ENV
from .calls import CallPolicy
from .discovery import DiscoveryConfig
from .futures import KEEP_DONE_BYTES
from .limits import HttpLimits, RequestLimits
from .sessions import SESSION_IDLE_S
from .store import StoreConfig
from .tls import TlsFiles

DEFAULT_DB = "sqlite:///.cache/lathe/control.db"
DB_ENV = "LATHE_DB_URL"  # the database URL from the environment: a password stays out of argv


def _db_url() -> str:
    return os.environ.get(DB_ENV, DEFAULT_DB)


def _keys_file() -> str:
    return os.environ.get(KEYS_FILE_ENV, "")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything ``python -m lathe.gateway`` is told but where it listens (``--host``, ``--port``,
    ``--metrics-port``)."""

    checkpoints: str = field(default="", metadata={"required": True})
    """address of the checkpoints service"""
    http_port: int = -1
    """serve the Tinker HTTP API (/api/v1) on this port (0: any free port, -1: off)"""
    http_public_url: str = ""
    """the HTTP door's root as clients reach it (e.g. https://lathe.example.com behind an Ingress), for the download
    URLs both doors sign (default: the gRPC door the scheme, --host and the HTTP port; the HTTP door the scheme and
    host each request arrived with)"""
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig, metadata={"flags": {
        "kind": "--discovery", "trainer": "--trainer", "sampler": "--sampler", "namespace": "--discovery-namespace",
        "selector": "--discovery-selector"}})
    """how the trainer and sampler pools are found"""
    api_keys_file: str = field(default="", metadata={"default": _keys_file})
    """file of KEY=TENANT lines (default: $LATHE_API_KEYS_FILE; none: open mode, loopback only)"""
    tls_cert: str = ""
    """PEM certificate for both public doors (with --tls-key)"""
    tls_key: str = ""
    """PEM private key of --tls-cert"""
    store: StoreConfig = field(default_factory=lambda: StoreConfig(DEFAULT_DB), metadata={
        "flags": {"url": ("--db", f"default ${DB_ENV}, else {DEFAULT_DB}"), "retention_s": "--ledger-retention-s",
                  "keep_done": "--ledger-keep"},
        "defaults": {"url": _db_url}})
    """the control plane's database (--db: default $LATHE_DB_URL, else a SQLite file in the cache directory)"""
    keep_result_bytes: int = KEEP_DONE_BYTES
    """finished results kept in memory, in bytes, oldest dropped first (an older one is read from the ledger while
    it holds it)"""
    calls: CallPolicy = field(default_factory=CallPolicy, metadata={"flags": {"retry_budget_s": "--retry-budget-s"}})
    """deadlines and retries of the gateway's calls to the services"""
    session_idle_s: float = SESSION_IDLE_S
    """a session not heard from this long (no heartbeat; both SDKs send one every 10 s) is finished when its tenant
    next opens a session or sampling session"""
    metrics_tenant_labels: int = 0
    """name this many tenants in the usage metrics' tenant label (0: every tenant is 'other')"""
    quotas: str = ""
    """per-tenant quotas, a JSON or .toml file (quotas.QuotaConfig)"""
    limits: RequestLimits = field(default_factory=RequestLimits)
    """what one request may ask for on either door"""
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    """what decoding one HTTP body may cost"""

    def __post_init__(self) -> None:
        if not self.session_idle_s > 0:
            raise ValueError(f"session_idle_s must be > 0, got {self.session_idle_s}")
        url = urlparse(self.http_public_url)
        if self.http_public_url and (url.scheme not in ("http", "https") or not url.netloc or url.query
                                     or url.fragment):
            raise ValueError(f"http_public_url {self.http_public_url!r} is not http(s)://host[:port][/path]")
        TlsFiles.from_args(self.tls_cert, self.tls_key)  # both or neither (its ValueError names them)
