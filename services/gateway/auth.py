"""API keys -> tenants. The same check serves the gRPC door and the Tinker HTTP door."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from lathe.errors import Unauthenticated

TINKER_KEY_PREFIX = "tml-"  # the only key form the official tinker SDK sends (it refuses others itself)


@dataclass(slots=True)
class ApiKeys:
    """Configured keys map to named tenants. With no keys configured (the embedded default), every
    distinct key is its own tenant, named from a hash of the key, so tenants stay apart all the same."""

    keys: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> ApiKeys:
        """``"key1=tenant-a,key2=tenant-b"`` (empty: open mode)."""
        keys = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, tenant = part.partition("=")
            if not sep or not key or not tenant:
                raise ValueError(f"api key entry {part!r} is not of the form KEY=TENANT")
            keys[key] = tenant
        return cls(keys)

    def tenant(self, api_key: str | None) -> str:
        if not api_key:
            raise Unauthenticated("missing API key: send it as the x-api-key header")
        if self.keys:
            if api_key not in self.keys:
                raise Unauthenticated("unknown API key")
            return self.keys[api_key]
        return "t-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]

    def tinker_tenant(self, api_key: str | None) -> str:
        """``tenant`` for the Tinker HTTP door, whose keys also carry Tinker's ``tml-`` prefix."""
        if api_key and not api_key.startswith(TINKER_KEY_PREFIX):
            raise Unauthenticated(f"the X-API-Key header must start with {TINKER_KEY_PREFIX!r}")
        return self.tenant(api_key)
