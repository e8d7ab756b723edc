"""The registry: what a tenant lists and manages of its own (sessions, runs, checkpoints), and nothing else's.

``Registry`` owns no state: sessions are ``SessionBook``'s, runs ``Runs``', checkpoints the checkpoints service's
(which refuses anyone's but the caller's). It pages the listings and checks the arguments of each change (TTLs,
the recovery kind reserved to the trainer) before the checkpoints service is asked.
"""

from __future__ import annotations

import functools
import json

from lathe.errors import InvalidArgument, NotFound, PermissionDenied
from lathe.types import CHECKPOINT_TYPES, MAX_TTL_S, RECOVERY_KIND, check_no_project
from lathe.v1 import checkpoints_pb2 as cpb
from lathe.v1 import checkpoints_pb2_grpc as cpb_grpc
from lathe.v1 import lathe_pb2 as pb

from .calls import Caller
from .copies import copy_checkpoint, copy_run_id
from .lookups import Lookups
from .quotas import Quotas
from .records import Run, Session
from .runs import Runs
from .session_search import SessionQuery, search
from .sessions import SessionBook
from .store import ControlStore


def _not_reserved(path: str, action: str) -> None:
    """Refuse a tenant's ``action`` on a trainer's recovery snapshot (``tinker://<run>/recovery/latest``): that kind
    is reserved to the trainer, which alone writes it and sets its expiry; a copy would be a checkpoint that no
    listing shows and no byte quota counts, and a deletion or a new TTL would lose the run's recovery. Read from
    the path alone, before any lookup, so the answer is the same whoever owns the run."""
    parts = path.removeprefix("tinker://").split("/")
    if len(parts) == 3 and parts[1] == RECOVERY_KIND:
        raise PermissionDenied(f"checkpoint {path!r} is a recovery snapshot: kind {RECOVERY_KIND!r} is reserved to "
                               f"the trainer, and its checkpoints cannot be {action}")


class Registry:
    def __init__(self, store: ControlStore, book: SessionBook, runs: Runs, lookups: Lookups, caller: Caller,
                 checkpoints: cpb_grpc.CheckpointsStub, quotas: Quotas) -> None:
        self.store, self.book, self.runs, self.lookups, self.caller = store, book, runs, lookups, caller
        self.checkpoints, self.quotas = checkpoints, quotas

    def list_sessions(self, tenant: str, limit: int, offset: int) -> list[str]:
        """A page of the tenant's session ids, newest first."""
        if limit < 1 or offset < 0:
            raise InvalidArgument(f"limit and offset must be >= 1 and >= 0, got limit={limit} offset={offset}")
        return self.store.list_sessions(tenant, limit, offset)

    async def search_sessions(self, tenant: str, query: SessionQuery
                              ) -> tuple[list[tuple[Session, list[cpb.CheckpointInfo]]], Session | None]:
        """A page of the tenant's sessions matching ``query`` (``session_search``), each with the live checkpoints
        of its runs, and the last one shown when more match; the cursor's session must be one of the tenant's."""
        start = None
        if query.after is not None:
            s = self.book.find(query.after)
            if s is None or s.tenant != tenant:
                raise NotFound(f"cursor.last_session_id {query.after!r} is not one of your sessions")
            start = (s.created_at, s.session_id)
        found, last = search(query, functools.partial(self.store.sessions_after, tenant), start)
        by_session: dict[str, list[cpb.CheckpointInfo]] = {}
        for c in await self.tenant_checkpoints(tenant) if found else ():
            by_session.setdefault(c.run_id.rpartition(":train:")[0], []).append(c)
        return [(s, by_session.get(s.session_id, [])) for s in found], last

    async def tenant_checkpoints(self, tenant: str) -> list[cpb.CheckpointInfo]:
        """Every live checkpoint of the tenant, with its size (the checkpoints service's listing)."""
        res = await self.caller.send(self.checkpoints.List, cpb.ListCheckpointsRequest(tenant=tenant))
        return list(res.checkpoints)

    async def storage_usage(self, tenant: str, project_id: str | None) -> tuple[int, int]:
        """How many live checkpoints the tenant has and their bytes, now (``project_id`` refused: no projects)."""
        check_no_project("project_id", project_id)
        checkpoints = await self.tenant_checkpoints(tenant)
        return len(checkpoints), sum(c.size_bytes for c in checkpoints)

    async def weights_info(self, tenant: str, path: str) -> pb.WeightsInfo:
        """The tenant's checkpoint's weights: base model and rank from its metadata, plus the LoRA module flags and
        the optimizer family while its run is in the registry (unset otherwise)."""
        info = await self.lookups.checkpoint(tenant, path)
        meta = json.loads(info.metadata_json or "{}")
        out = pb.WeightsInfo(base_model=meta.get("base_model", ""), is_lora=True, lora_rank=meta.get("r"))
        run = self.runs.find(tenant, info.run_id)
        if run is not None:
            out.train_mlp, out.train_attn = run.lora.train_mlp, run.lora.train_attn
            out.train_unembed, out.optimizer = run.lora.train_unembed, run.optimizer
        return out

    def session_members(self, tenant: str, session_id: str) -> tuple[Session, list[str], list[str]]:
        """The tenant's session, its training run ids and its sampling session ids."""
        return self.book.mine(tenant, session_id), *self.store.session_members(session_id)

    def list_runs(self, tenant: str, limit: int, offset: int, project_id: str | None = None
                  ) -> tuple[list[Run], int]:
        """A page of the tenant's training runs, oldest first (``limit`` 0: 20), and how many there are
        (``project_id`` refused: no projects)."""
        check_no_project("project_id", project_id)
        if limit < 0 or offset < 0:
            raise InvalidArgument(f"limit and offset must be >= 0, got limit={limit} offset={offset}")
        mine = self.runs.of(tenant)
        return mine[offset:offset + (limit or 20)], len(mine)

    async def list_checkpoints(self, tenant: str, run_id: str, limit: int, offset: int
                               ) -> pb.ListRunCheckpointsResponse:
        if run_id:
            self.runs.get(tenant, run_id)
        res = await self.caller.send(self.checkpoints.List, cpb.ListCheckpointsRequest(
            tenant=tenant, run_id=run_id, limit=limit, offset=offset))
        return pb.ListRunCheckpointsResponse(total_count=res.total_count, checkpoints=[
            pb.CheckpointEntry(checkpoint_id=f"{c.kind}/{c.name}",
                               checkpoint_type=CHECKPOINT_TYPES[c.kind],
                               tinker_path=c.path, time=c.created_at, size_bytes=c.size_bytes,
                               expires_at=c.expires_at, public=c.public,
                               user_metadata=json.loads(c.metadata_json or "{}").get("user_metadata", {}))
            for c in res.checkpoints
        ])

    async def delete_checkpoint(self, tenant: str, path: str) -> None:
        _not_reserved(path, "deleted")
        await self.caller.send(self.checkpoints.Delete, cpb.CheckpointRef(tenant=tenant, path=path), idempotent=False)

    async def copy_checkpoint(self, tenant: str, source: str, ttl_seconds: int | None, idempotency_key: str | None,
                              session_id: str | None = None, model_seq_id: int | None = None) -> str:
        """Copy the tenant's checkpoint at ``source`` (``copies``) and return the copy's path; it expires after
        ``ttl_seconds`` (None: never). It goes under run ``"{session_id}:train:{model_seq_id}"`` (a slot no run
        holds) when the session is given, else under a run id of its own derived from ``idempotency_key``; no run
        is registered (the copy cannot be trained on)."""
        _not_reserved(source, "copied")
        if ttl_seconds is not None and not 1 <= ttl_seconds <= MAX_TTL_S:
            raise InvalidArgument(f"ttl_seconds = {ttl_seconds} must be in [1, {MAX_TTL_S}], or null for no expiry")
        if session_id is None:
            run_id = copy_run_id(tenant, idempotency_key)
        else:
            self.book.open(tenant, session_id)
            if model_seq_id is None or model_seq_id < 0:
                raise InvalidArgument(f"model_seq_id = {model_seq_id} must be >= 0 with session_id")
            run_id = f"{session_id}:train:{model_seq_id}"
            if self.runs.find_any(run_id) is not None:
                raise InvalidArgument(f"model_seq_id {model_seq_id} of session {session_id!r} holds training run "
                                      f"{run_id!r}; copy into a slot of its own")
            self.store.number(session_id, "next_model", model_seq_id)  # no later run takes the slot
        info = await copy_checkpoint(self.checkpoints, tenant, source, run_id, ttl_seconds or 0,
                                     self.quotas.of(tenant).max_checkpoint_bytes)
        return info.path

    async def set_checkpoint_ttl(self, tenant: str, path: str, ttl_seconds: int | None) -> None:
        """The caller's checkpoint at ``path`` expires ``ttl_seconds`` from now (None: never)."""
        _not_reserved(path, "given another TTL")
        if ttl_seconds is not None and not 0 < ttl_seconds <= MAX_TTL_S:
            raise InvalidArgument(f"ttl_seconds = {ttl_seconds} must be in [1, {MAX_TTL_S}], or null to remove the "
                                  "expiration")
        await self.caller.send(self.checkpoints.SetTtl, cpb.SetTtlRequest(tenant=tenant, path=path,
                                                                          ttl_seconds=ttl_seconds or 0))

    async def set_checkpoint_public(self, tenant: str, path: str, public: bool) -> None:
        _not_reserved(path, "published")
        await self.caller.send(self.checkpoints.SetPublic,
                               cpb.SetPublicRequest(tenant=tenant, path=path, public=public), idempotent=False)
