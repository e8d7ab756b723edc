"""The Tinker HTTP routes of the client and its sessions: health, the client's configuration, sessions (create, keep
alive, finish, list, search), the account (token, storage usage) and the server's capabilities.

Each handler reads its body through ``tinker_io.Bodies`` and makes one call on the core's ``SessionBook``,
``Registry`` or ``Lookups``; it keeps no state of its own.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request

from lathe.types import check_no_project

from . import tinker_json as tj
from .core import GatewayCore
from .session_search import SessionQuery
from .tinker_io import Bodies, query_int

CLIENT_CONFIG = {"use_pyqwest_transport": False, "pjwt_auth_enabled": False, "proto_compress_fwdbwd": True,
                 "sample_use_retrieve_futures": True, "sample_join_sampling_session": True,
                 "custom_loss_server_side": True}
DYNAMIC_CONFIG = {"sample_cancel_enabled": True}


class SessionRoutes:
    """Health, the client's configuration, sessions and the account."""

    def __init__(self, core: GatewayCore, bodies: Bodies) -> None:
        self.core = core
        self.bodies = bodies

    async def healthz(self, request: Request, tenant: str) -> dict[str, Any]:
        """Tinker's readiness probe: the door is up and the caller's key is accepted."""
        return {"status": "ok"}

    async def client_config(self, request: Request, tenant: str) -> dict[str, Any]:
        return CLIENT_CONFIG

    async def dynamic_config(self, request: Request, tenant: str) -> dict[str, Any]:
        return DYNAMIC_CONFIG

    async def create_session(self, request: Request, tenant: str) -> dict[str, Any]:
        f = await self.bodies.fields(request)
        check_no_project("project_id", f.get("project_id", str, None))
        session_id = self.core.book.create(tenant, f.strings("user_metadata"), f.get("display_name", str, None))
        return {"type": "create_session", "session_id": session_id}

    async def session_heartbeat(self, request: Request, tenant: str) -> dict[str, Any]:
        self.core.book.heartbeat(tenant, (await self.bodies.fields(request)).get("session_id", str))
        return {"type": "session_heartbeat"}

    async def telemetry(self, request: Request, tenant: str) -> dict[str, Any]:
        return {"status": "accepted"}  # accepted and dropped: Lathe exports its own metrics

    async def finish_session(self, request: Request, tenant: str) -> dict[str, Any]:
        reason = (await self.bodies.fields(request)).sub("reason", required=False).get("type", str, "")
        self.core.book.finish(tenant, request.path_params["session_id"], reason)
        return {}

    async def list_sessions(self, request: Request, tenant: str) -> dict[str, Any]:
        """The caller's sessions, newest first (``access_scope`` aside: a tenant sees only its own)."""
        limit, offset = query_int(request, "limit", 20), query_int(request, "offset", 0)
        return {"sessions": self.core.registry.list_sessions(tenant, limit, offset)}

    async def get_session(self, request: Request, tenant: str) -> dict[str, Any]:
        s, run_ids, sampler_ids = self.core.registry.session_members(tenant, request.path_params["session_id"])
        return {"training_run_ids": run_ids, "sampler_ids": sampler_ids, "user_metadata": s.user_metadata,
                "display_name": s.display_name}

    async def search_sessions(self, request: Request, tenant: str) -> dict[str, Any]:
        """A page of the caller's sessions matching the filters (``session_search``), each with the count and bytes
        of its runs' live checkpoints."""
        query = SessionQuery.from_fields(await self.bodies.fields(request))
        found, last = await self.core.registry.search_sessions(tenant, query)
        return {"sessions": [tj.session_summary(s, checkpoints) for s, checkpoints in found],
                "next_cursor": None if last is None else {"last_created_at": tj.iso(last.created_at),
                                                          "last_session_id": last.session_id}}

    async def auth_token(self, request: Request, tenant: str) -> dict[str, Any]:
        """A token naming the caller (``tinker_json.identity_token``): Lathe keeps to API keys, and answers so that
        an SDK told to exchange its key goes on."""
        return {"jwt": tj.identity_token(tenant, time.time())}

    async def storage_usage(self, request: Request, tenant: str) -> dict[str, Any]:
        """The caller's live checkpoints, counted and summed (``project_id`` is refused: Lathe has no projects)."""
        count, size = await self.core.registry.storage_usage(tenant, request.query_params.get("project_id", "")[:64])
        return tj.storage_usage(tenant, count, size)

    async def get_server_capabilities(self, request: Request, tenant: str) -> dict[str, Any]:
        return tj.capabilities(await self.core.lookups.capabilities())
