"""The Tinker HTTP routes of a tenant's registry: training runs and checkpoints (list, copy, delete, TTL, publish,
weights info) and their downloads (signed URLs and the files they name, ``downloads.py``).

Each handler makes one call on the core's ``Registry`` or ``Runs``, or on ``Downloads``; it keeps no state of its own.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from lathe.errors import InvalidArgument, LatheError

from . import tinker_json as tj
from .core import GatewayCore
from .downloads import Downloads
from .tinker_io import PREFIX, Bodies, error_response, query_int


def _checkpoint_path(request: Request) -> str:
    p = request.path_params
    return f"tinker://{p['run_id']}/{p['kind']}/{p['name']}"


class RegistryRoutes:
    """Training runs, checkpoints and their downloads."""

    def __init__(self, core: GatewayCore, bodies: Bodies, downloads: Downloads, public_url: str) -> None:
        """``public_url``: the root of the download URLs ("": the scheme and host each request arrived with)."""
        self.core = core
        self.bodies = bodies
        self.downloads = downloads
        self.public_url = public_url

    async def list_training_runs(self, request: Request, tenant: str) -> dict[str, Any]:
        limit, offset = query_int(request, "limit", 20), query_int(request, "offset", 0)
        runs, total = self.core.registry.list_runs(tenant, limit, offset, request.query_params.get("project_id"))
        return {"training_runs": [tj.training_run(r) for r in runs], "cursor": tj.cursor(offset, limit, total)}

    async def get_training_run(self, request: Request, tenant: str) -> dict[str, Any]:
        return tj.training_run(self.core.runs.get(tenant, request.path_params["run_id"]))

    async def list_run_checkpoints(self, request: Request, tenant: str) -> dict[str, Any]:
        res = await self.core.registry.list_checkpoints(tenant, request.path_params["run_id"], 0, 0)
        return {"checkpoints": [tj.checkpoint(c) for c in res.checkpoints]}

    async def list_user_checkpoints(self, request: Request, tenant: str) -> dict[str, Any]:
        limit, offset = query_int(request, "limit", 100), query_int(request, "offset", 0)
        res = await self.core.registry.list_checkpoints(tenant, "", limit, offset)
        return {"checkpoints": [tj.checkpoint(c) for c in res.checkpoints],
                "cursor": tj.cursor(offset, limit, res.total_count)}

    async def copy_weights(self, request: Request, tenant: str) -> dict[str, Any]:
        """A copy of one of the caller's checkpoints at a new path (``Registry.copy_checkpoint``), answered at
        once. ``destination_project_id`` names nothing here (the copy stays the caller's); the
        ``X-Idempotency-Key`` the SDK keeps across its retries makes a retry answer the first copy."""
        f = await self.bodies.fields(request)
        if f.get("weights_access_token", str, None) or request.headers.get("x-tinker-weights-access-token"):
            raise InvalidArgument("weights_access_token is not supported: copy checkpoints of your own account")
        path = await self.core.registry.copy_checkpoint(
            tenant, f.get("source_path", str), f.get("ttl_seconds", int, None),
            request.headers.get("x-idempotency-key"), f.get("session_id", str, None), f.get("model_seq_id", int, None))
        return {"tinker_path": path}

    async def delete_checkpoint(self, request: Request, tenant: str) -> dict[str, Any]:
        p = request.path_params
        await self.core.registry.delete_checkpoint(tenant, f"tinker://{p['run_id']}/{p['checkpoint_id']}")
        return {}

    async def set_checkpoint_ttl(self, request: Request, tenant: str) -> dict[str, Any]:
        """``{"ttl_seconds": n}``: expire n seconds from now; ``null``: never."""
        ttl = (await self.bodies.fields(request)).get("ttl_seconds", int, None)
        await self.core.registry.set_checkpoint_ttl(tenant, _checkpoint_path(request), ttl)
        return {}

    async def publish_checkpoint(self, request: Request, tenant: str) -> dict[str, Any]:
        await self.core.registry.set_checkpoint_public(tenant, _checkpoint_path(request), True)
        return {}

    async def unpublish_checkpoint(self, request: Request, tenant: str) -> dict[str, Any]:
        await self.core.registry.set_checkpoint_public(tenant, _checkpoint_path(request), False)
        return {}

    async def weights_info(self, request: Request, tenant: str) -> dict[str, Any]:
        """``Registry.weights_info`` (without the checkpoint's run in the registry, Tinker's default: AdamW)."""
        path = (await self.bodies.fields(request)).get("tinker_path", str)
        return tj.weights_info(await self.core.registry.weights_info(tenant, path))

    # ---- downloads ----

    async def external_weights_urls(self, request: Request, tenant: str) -> dict[str, Any]:
        root = self.public_url or str(request.base_url).rstrip("/")
        return await self.downloads.urls(tenant, _checkpoint_path(request), root + PREFIX)

    async def checkpoint_file(self, request: Request) -> Response:
        """The file a signed download URL names (no API key: the signature is the authority)."""
        try:
            return await self.downloads.file(request.path_params["token"])
        except LatheError as e:
            return error_response(e)
