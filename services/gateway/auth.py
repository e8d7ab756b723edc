"""API keys -> tenants. The same check serves the gRPC door and the Tinker HTTP door.

Keys come from a file (``--api-keys-file``, or the file named by ``LATHE_API_KEYS_FILE``; in the chart a mounted
Secret), never from argv, which ``ps`` shows. One entry a line, ``KEY=TENANT`` or ``sha256:HEX=TENANT`` (the key's
SHA-256 in hex, so the file need not hold the key itself); blank lines and ``#`` comments are skipped. Only
the keys' SHA-256 digests are kept in memory, and a presented key's digest is compared with every configured one
in constant time (``hmac.compare_digest``, no early exit).

Without a file the gateway runs in open mode: every distinct key is its own tenant, named from the key's hash.
That is for the embedded stack on loopback only: ``require_safe`` refuses open mode on any other address.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from pathlib import Path

from lathe.errors import FailedPrecondition, Unauthenticated
from lathe.runtime.internal_auth import is_loopback

TINKER_KEY_PREFIX = "tml-"  # the only key form the official tinker SDK sends (it refuses others itself)
KEYS_FILE_ENV = "LATHE_API_KEYS_FILE"
_HEX_DIGEST = re.compile(r"sha256:([0-9a-fA-F]{64})")


def _digest(api_key: str) -> bytes:
    return hashlib.sha256(api_key.encode()).digest()


@dataclass(slots=True)
class ApiKeys:
    """Configured keys (as SHA-256 digests) map to named tenants; none configured is open mode."""

    digests: list[tuple[bytes, str]] = field(default_factory=list)

    @property
    def open_mode(self) -> bool:
        return not self.digests

    @classmethod
    def parse(cls, text: str, source: str = "the API keys") -> ApiKeys:
        """Entries ``KEY=TENANT`` or ``sha256:HEX=TENANT``, one a line."""
        digests = []
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, tenant = line.rpartition("=")
            key, tenant = key.strip(), tenant.strip()
            if not sep or not key or not tenant:
                raise ValueError(f"{source}, line {n}: not of the form KEY=TENANT or sha256:HEX=TENANT")
            hashed = _HEX_DIGEST.fullmatch(key)
            digests.append((bytes.fromhex(hashed[1]) if hashed else _digest(key), tenant))
        if not digests:
            raise ValueError(f"{source} configure no key (leave the file out for open mode)")
        return cls(digests)

    @classmethod
    def from_file(cls, path: Path | str | None) -> ApiKeys:
        """The keys in the file at ``path``; no path (or "") is open mode."""
        return cls.parse(Path(path).read_text(), f"API keys file {path}") if path else cls()

    def require_safe(self, host: str) -> None:
        """Refuse open mode on an address that other machines reach."""
        if not self.open_mode:
            return
        if not is_loopback(host):
            raise FailedPrecondition(f"the gateway would serve anyone on {host} in open mode (every key its own "
                                     f"tenant): give --api-keys-file (or {KEYS_FILE_ENV}), or listen on loopback")

    def tenant(self, api_key: str | None) -> str:
        if not api_key:
            raise Unauthenticated("missing API key: send it as the x-api-key header")
        digest = _digest(api_key)
        if self.open_mode:
            return "t-" + digest.hex()[:16]
        found = None
        for known, tenant in self.digests:  # every entry, so the time does not say which one matched
            if hmac.compare_digest(digest, known):
                found = tenant
        if found is None:
            raise Unauthenticated("unknown API key")
        return found

    def tinker_tenant(self, api_key: str | None) -> str:
        """``tenant`` for the Tinker HTTP door, whose keys also carry Tinker's ``tml-`` prefix."""
        if api_key and not api_key.startswith(TINKER_KEY_PREFIX):
            raise Unauthenticated(f"the X-API-Key header must start with {TINKER_KEY_PREFIX!r}")
        return self.tenant(api_key)
