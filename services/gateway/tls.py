"""TLS for the gateway's public doors: one certificate and key (PEM files) serve the gRPC door and the HTTP door.

Internal services stay plaintext behind the stack's shared secret and the chart's NetworkPolicies.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: Path
    key: Path

    @classmethod
    def from_args(cls, cert: str, key: str) -> TlsFiles | None:
        """Both paths or neither (plaintext doors)."""
        if bool(cert) != bool(key):
            raise ValueError("--tls-cert and --tls-key go together: give both, or neither for plaintext doors")
        return cls(Path(cert), Path(key)) if cert else None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])
